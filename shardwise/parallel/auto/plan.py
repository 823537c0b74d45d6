"""``ParallelizePlan``: what ``sw.auto`` chose, as plain data — the ``pattern -> style`` mapping
``sw.parallelize`` takes, which mesh axes carry data parallelism and which carries tensor parallelism, and the
prices behind the choice. (``sw.Plan`` is an alias of it, the name it had first.)

    plan = sw.auto(model, mesh, example_inputs=(ids,))
    print(plan)                                    # layouts, styles, and per module group the rejected prices
    plan = plan.edit({"lm_head": "B"})             # plain edits (the prices are dropped: re-run auto with pins)
    if plan.tp_axis or plan.cp_axis:
        model = sw.parallelize(model, mesh, plan)  # axis taken from plan.tp_axis; ContextParallel applied last
    model = sw.DataParallel(model, mesh, axis=plan.dp_axes[0])   # (the data axis of size > 1)

``ParallelizePlan.from_text(str(plan))`` and ``ParallelizePlan.from_json(plan.to_json())`` give back an equal
plan (its styles and axes; the text keeps the prices for reading only).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..expert.style import ExpertParallel
from ..tensor.styles import STYLES, ContextParallel, Style

__all__ = ["ParallelizePlan", "Plan", "Row", "parse_style", "format_style", "why_replicated"]

_BY_NAME = {cls.__name__: cls for cls in (*STYLES, ContextParallel, ExpertParallel)}


def format_style(style: Style) -> str:
    return repr(style)  # Name(field=value, ...); ColumnParallel leaves out parts=1


def parse_style(text: str) -> Style:
    """``"ColumnParallel(heads=4)"`` -> the style; ``ValueError`` naming the accepted forms otherwise."""
    m = re.fullmatch(r"\s*(\w+)\((.*)\)\s*", text)
    if m is None or m.group(1) not in _BY_NAME:
        raise ValueError(f"cannot read style {text!r}; write one of {sorted(_BY_NAME)} with keyword args, "
                         f"e.g. 'ColumnParallel(heads=4)'")
    call = ast.parse(f"f({m.group(2)})", mode="eval").body
    assert isinstance(call, ast.Call)
    kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
    return _BY_NAME[m.group(1)](**kwargs)


@dataclass(frozen=True)
class Row:
    """One group of modules (a pattern) in the price table."""

    pattern: str
    kind: str
    """Chosen: ``B`` (replicated on the tp axis; data parallel), ``column``, ``row``, ``vocab``, ``experts``."""
    time_s: float
    """The group's own price under the chosen plan (compute + tp communication + gradient all-reduce)."""
    alternatives: tuple[tuple[str, float | None, str], ...]
    """``(kind, predicted step time of the best plan with this group forced to kind or None, why not)``."""
    module_type: str = ""
    """The class name of the group's modules (for the reason a module stays replicated)."""
    pinned: bool = False
    """The user's ``pins=`` fixed this group's layout."""


@dataclass(frozen=True)
class ParallelizePlan(Mapping[str, Style]):
    """A mapping ``module-name pattern -> style`` plus the axes and the prices (see module docstring)."""

    styles: Mapping[str, Style]
    tp_axis: str | None
    """The mesh axis the styles split over (None: pure data parallelism, no styles)."""
    dp_axes: tuple[str, ...]
    """The mesh axes the batch is split over (every other axis)."""
    vocab_parallel_loss: bool = False
    """The model's output is vocabulary-split: compute the loss with ``vocab_parallel_cross_entropy`` (a Hugging
    Face model's own ``.loss`` is made right by ``sw.parallelize``)."""
    time_s: float | None = None
    """Predicted step time (None after an edit)."""
    memory: float | None = None
    """Predicted bytes per rank (parameters, gradients, Adam moments, saved activations)."""
    exact: bool = True
    layouts: tuple[tuple[str, float | None, str], ...] = ()
    """``(layout, predicted step time or None, note)`` for every axis choice considered."""
    rows: tuple[Row, ...] = ()
    context: str = ""
    """What ``sw.auto`` decided about context parallelism, as printed: the ``"": ContextParallel(axis)`` entry's
    reason, or why the mesh's cp axis was not used ("" when the mesh has none)."""

    @property
    def cp_axis(self) -> str | None:
        """The axis of the plan's ``ContextParallel`` entry (None: no context parallelism)."""
        style = self.styles.get("")
        return style.axis if isinstance(style, ContextParallel) else None

    def __getitem__(self, key: str) -> Style:
        return self.styles[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.styles)

    def __len__(self) -> int:
        return len(self.styles)

    def edit(self, changes: Mapping[str, Style | str]) -> "ParallelizePlan":
        """A copy with ``changes`` applied (``"B"`` removes a pattern: replicated); prices dropped."""
        styles = dict(self.styles)
        for pattern, style in changes.items():
            if style in ("B", "replicate"):
                styles.pop(pattern, None)
            elif isinstance(style, (*STYLES, ContextParallel, ExpertParallel)):
                styles[pattern] = style
            else:
                raise ValueError(f"edit({pattern!r}: {style!r}): give a style object or 'B' (replicated)")
        return ParallelizePlan(styles, self.tp_axis, self.dp_axes, self.vocab_parallel_loss, exact=self.exact)

    def to_json(self) -> dict[str, Any]:
        return {"styles": {k: format_style(v) for k, v in self.styles.items()}, "tp_axis": self.tp_axis,
                "dp_axes": list(self.dp_axes), "vocab_parallel_loss": self.vocab_parallel_loss,
                "time_s": self.time_s, "memory": self.memory}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "ParallelizePlan":
        return ParallelizePlan({k: parse_style(v) for k, v in data["styles"].items()}, data["tp_axis"],
                    tuple(data["dp_axes"]), bool(data.get("vocab_parallel_loss", False)), data.get("time_s"),
                    data.get("memory"))

    @staticmethod
    def from_text(text: str) -> "ParallelizePlan":
        """Read back the axes and styles of ``str(plan)`` (possibly edited by hand)."""
        head = re.search(r"tp axis: (\S+); data axes: \[(.*?)\]; vocab-parallel loss: (\w+)", text)
        if head is None:
            raise ValueError("not a printed sw.auto plan: its first line names the tp axis and data axes")
        tp = None if head.group(1) == "none" else head.group(1).strip("'")
        dp = tuple(a.strip().strip("'") for a in head.group(2).split(",") if a.strip())
        body = text.split("styles:", 1)[1].split("\n\n", 1)[0] if "styles:" in text else ""
        styles = {}
        for line in body.splitlines():
            if "->" in line:
                pattern, _, style = line.partition("->")
                styles[pattern.strip()] = parse_style(style.strip())
        return ParallelizePlan(styles, tp, dp, head.group(3) == "yes")

    def __str__(self) -> str:
        return "\n".join(_lines(self))


def _ms(t: float | None) -> str:
    return "-" if t is None else f"{t * 1e3:.3f} ms"


Plan = ParallelizePlan
"""The first name of ``ParallelizePlan`` (``sw.Plan``): the same class."""


def _lines(plan: ParallelizePlan) -> list[str]:
    tp = repr(plan.tp_axis) if plan.tp_axis else "none"
    out = [f"sw.auto plan -- tp axis: {tp}; data axes: [{', '.join(repr(a) for a in plan.dp_axes)}]; "
           f"vocab-parallel loss: {'yes' if plan.vocab_parallel_loss else 'no'}"]
    if plan.context:
        out.append(plan.context)
    if plan.time_s is not None:
        mem = "-" if plan.memory is None else f"{plan.memory / 2**20:.2f} MiB"
        out.append(f"predicted step {_ms(plan.time_s)}, {mem} per rank"
                   f"{'' if plan.exact else ' (beam search: not proven optimal)'}")
    if plan.layouts:
        out += ["", "layouts (best plan of each axis choice):"]
        out += [f"  {label:<28} {_ms(t):>14}  {note}" for label, t, note in plan.layouts]
    out += ["", "styles:"] + [f"  {k} -> {format_style(v)}" for k, v in plan.styles.items()]
    if not any(not isinstance(v, ContextParallel) for v in plan.styles.values()):
        out.append("  (none: every module replicated on the tp axis)")
    if plan.rows:
        out += ["", "modules (own price; step time of the best plan with the group forced to each alternative):"]
        for r in plan.rows:
            alts = "  ".join(f"{k}: {_ms(t) if t is not None else 'n/a (' + why + ')'}"
                             for k, t, why in r.alternatives) or "(no alternative)"
            out.append(f"  {r.pattern:<44} {r.kind:<7} {_ms(r.time_s):>12}  | {alts}")
            if r.kind == "B":
                out.append(f"      replicated: {why_replicated(r, plan.time_s)}")
    return out


def why_replicated(row: Row, step_s: float | None) -> str:
    """Why ``row``'s modules stay replicated on the tp axis, with the change that would split them. Pure."""
    if row.pinned:
        return (f"pinned by the user (a pins= pattern matching {row.pattern!r} asks 'B'); drop that pin to let "
                f"sw.auto price the splits")
    if not row.alternatives:
        return (f"no tensor-parallel layout for {row.module_type or 'this module type'} (sw.parallelize splits "
                f"nn.Linear and nn.Embedding); it runs data parallel")
    priced = [(t, k) for k, t, _ in row.alternatives if t is not None]
    if not priced:
        reasons = "; ".join(f"{k}: {why}" for k, _, why in row.alternatives)
        return f"no split fits its shapes ({reasons}); choose a tp size that divides them, or pad the dimension"
    t, kind = min(priced)
    if step_s is None:
        return f"too small to pay: {kind} gives a step of {_ms(t)}; replicated is cheaper"
    extra = (t - step_s) / step_s * 100 if step_s > 0 else 0.0
    return (f"too small to pay: the best alternative, {kind}, predicts a step of {_ms(t)} vs {_ms(step_s)} "
            f"replicated (+{extra:.1f} %); it pays with larger layers, a larger batch or faster links, or "
            f"pins={{{row.pattern!r}: {kind!r}}} forces it")
