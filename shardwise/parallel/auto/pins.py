"""``pins=`` of ``sw.auto``: fix some modules' layouts by name pattern; the rest of the plan adapts.

    pins={"lm_head": "B"}                        # replicated on the tp axis (data parallel)
    pins={"model.layers.*.mlp.down_proj": "row"}
    pins={"lm_head": {"tp": "vocab"}}            # per mesh axis (the named axis becomes the tp axis)
    pins={"*.q_proj": sw.ColumnParallel(heads=8)}

Values: ``"B"`` (alias ``"replicate"``), ``"column"``, ``"row"``, ``"vocab"``, ``"experts"``, a style object
(ColumnParallel/QKVParallel -> column, RowParallel -> row, VocabParallel -> vocab, ExpertParallel -> experts), or a dict
``{axis: value}``. Patterns are ``fnmatch`` over the planned modules' names (``named_modules()``).
Pure; bad pins raise a one-line ``ValueError`` with the fix.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..expert.style import ExpertParallel
from ..tensor.styles import ColumnParallel, QKVParallel, RowParallel, Style, VocabParallel

__all__ = ["Pin", "parse_pins"]

_ALIASES = {"B": "B", "replicate": "B", "column": "column", "row": "row", "vocab": "vocab", "experts": "experts"}
_STYLE_KIND = {ColumnParallel: "column", QKVParallel: "column", RowParallel: "row", VocabParallel: "vocab",
               ExpertParallel: "experts"}


@dataclass(frozen=True)
class Pin:
    kind: str
    axis: str | None
    """The axis a non-``B`` pin splits over (None: whichever axis carries tp)."""
    style: Style | None = None
    pattern: str = ""


def _one(pattern: str, value: Any, axis: str | None) -> Pin:
    if isinstance(value, str):
        if value not in _ALIASES:
            raise ValueError(f"pins[{pattern!r}] = {value!r}: use one of {sorted(_ALIASES)}, a style object "
                             f"(e.g. sw.ColumnParallel()) or a dict {{axis: value}}")
        return Pin(_ALIASES[value], axis, None, pattern)
    kind = _STYLE_KIND.get(type(value))
    if kind is None:
        raise ValueError(f"pins[{pattern!r}] = {value!r}: only ColumnParallel, QKVParallel, RowParallel, "
                         f"VocabParallel and ExpertParallel styles can be pinned (sw.auto plans without sequence "
                         f"parallelism)")
    return Pin(kind, axis, value, pattern)


def _from_axes(pattern: str, value: Mapping[str, Any], axes: Sequence[str]) -> Pin:
    bad = [a for a in value if a not in axes]
    if bad:
        raise ValueError(f"pins[{pattern!r}] names mesh axis {bad[0]!r}, but the mesh has {list(axes)}; key the "
                         f"dict by those axes, e.g. {{{axes[-1]!r}: 'column'}}")
    split = [(a, _one(pattern, v, a)) for a, v in value.items()]
    split = [(a, p) for a, p in split if p.kind != "B"]
    if len(split) > 1:
        raise ValueError(f"pins[{pattern!r}] splits over {[a for a, _ in split]}; sw.auto splits weights over one "
                         f"tensor-parallel axis: keep one axis non-'B'")
    return split[0][1] if split else Pin("B", None, None, pattern)


def parse_pins(pins: Mapping[str, Any] | None, units: Sequence[str], axes: Sequence[str]) -> dict[str, Pin]:
    """``{unit name: Pin}``. ``ValueError`` for a pattern matching no planned module, an unknown value or axis,
    or one module pinned two ways."""
    if pins is None:
        return {}
    if not isinstance(pins, Mapping):
        raise TypeError(f"pins must be a dict of module-name pattern -> layout, got {type(pins).__name__}")
    out: dict[str, Pin] = {}
    for pattern, value in pins.items():
        pin = _from_axes(pattern, value, axes) if isinstance(value, Mapping) else _one(pattern, value, None)
        hits = [u for u in units if fnmatch.fnmatchcase(u, pattern)]
        if not hits:
            sample = ", ".join(units[:6])
            raise ValueError(f"pins pattern {pattern!r} matches no planned module (modules with parameters); "
                             f"they look like: {sample}, ... (fnmatch, e.g. 'model.layers.*.mlp.down_proj')")
        for u in hits:
            if u in out and (out[u].kind, out[u].axis) != (pin.kind, pin.axis):
                raise ValueError(f"module {u!r} is pinned two ways ({out[u].pattern!r}: {out[u].kind}, {pattern!r}: "
                                 f"{pin.kind}); make the pin patterns disjoint")
            out[u] = pin
    return out
