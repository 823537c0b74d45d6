"""SBP placements: how one logical tensor lies on one mesh axis.

| placement      | short | meaning                                                                     |
|----------------|-------|-----------------------------------------------------------------------------|
| ``Split(d)``   | S(d)  | cut along tensor dim ``d``, one piece per rank of the axis (``shard_sizes``) |
| ``Replicate()``| B     | every rank of the axis holds the whole tensor                               |
| ``Partial(op)``| P     | the logical value is ``op`` (sum or max) over the ranks' tensors            |

``Replicate`` is written ``B`` ("broadcast", OneFlow's SBP notation); ``parse_sbp`` also reads ``R``, and
``Broadcast`` is an alias of ``Replicate`` (the same class).

A tensor on an n-axis mesh has one placement per axis ("SBP signature"). When several axes split the same
dim, the split is nested in axis order: the outer axis cuts first and each inner axis cuts the outer piece.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence, Union

__all__ = ["Split", "Replicate", "Broadcast", "Partial", "Placement", "parse_sbp", "format_sbp", "normalize_sbp"]


@dataclass(frozen=True)
class Split:
    """S(dim): the tensor is cut along ``dim`` across the axis."""

    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Split dim must be an int, got {self.dim!r}")

    def __str__(self) -> str:
        return f"S({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """B (or R): every rank of the axis holds the whole tensor. ``Broadcast`` is an alias."""

    def __str__(self) -> str:
        return "B"


@dataclass(frozen=True)
class Partial:
    """P: the logical tensor is the elementwise ``op`` (``"sum"`` or ``"max"``) of the ranks' tensors."""

    op: Literal["sum", "max"] = "sum"

    def __post_init__(self) -> None:
        if self.op not in ("sum", "max"):
            raise ValueError(f"Partial op must be 'sum' or 'max', got {self.op!r}")

    def __str__(self) -> str:
        return "P" if self.op == "sum" else "P(max)"


Broadcast = Replicate
"""The SBP name of ``Replicate`` (its short form ``B``): the same class."""

Placement = Union[Split, Replicate, Partial]
_TOKEN = re.compile(r"\s*(S\(\s*(-?\d+)\s*\)|B|R|P\(\s*max\s*\)|P\(\s*sum\s*\)|P)\s*")


def parse_sbp(text: str) -> tuple[Placement, ...]:
    """Parse the short form: ``"S(0),B"`` → ``(Split(dim=0), Replicate())`` (``R`` reads as ``B``);
    ``"P(max)"`` is a max-partial."""
    out: list[Placement] = []
    for part in text.split(","):
        m = _TOKEN.fullmatch(part)
        if m is None:
            raise ValueError(f"cannot parse SBP {part.strip()!r} in {text!r}; use S(dim), B, P or P(max), "
                             f"comma-separated, one per mesh axis (e.g. 'S(0),B')")
        token = m.group(1).replace(" ", "")
        if token.startswith("S"):
            out.append(Split(int(m.group(2))))
        elif token in ("B", "R"):
            out.append(Replicate())
        else:
            out.append(Partial("max" if "max" in token else "sum"))
    return tuple(out)


def format_sbp(sbp: Sequence[Placement]) -> str:
    return ",".join(str(p) for p in sbp)


def normalize_sbp(sbp: Sequence[Placement] | str | Placement, ndim: int, n_axes: int) -> tuple[Placement, ...]:
    """Validate an SBP signature for a tensor of ``ndim`` dims on a mesh of ``n_axes`` axes; negative split
    dims are made positive. Raises ``ValueError`` naming the constraint, the values and the fix."""
    if isinstance(sbp, str):
        sbp = parse_sbp(sbp)
    elif isinstance(sbp, (Split, Replicate, Partial)):
        sbp = (sbp,)
    sbp = tuple(sbp)
    if len(sbp) != n_axes:
        raise ValueError(f"SBP {format_sbp(sbp)!r} has {len(sbp)} placements but the mesh has {n_axes} axes; "
                         f"give one placement per mesh axis")
    out: list[Placement] = []
    for p in sbp:
        if not isinstance(p, (Split, Replicate, Partial)):
            raise TypeError(f"placements are sw.Split(dim), sw.Replicate() or sw.Partial(op), got {p!r}")
        if isinstance(p, Split):
            if not -ndim <= p.dim < ndim:
                raise ValueError(f"Split dim {p.dim} is out of range for a {ndim}-d tensor; use a dim in "
                                 f"[{-ndim}, {ndim - 1}]")
            p = Split(p.dim % ndim)
        out.append(p)
    ops = {p.op for p in out if isinstance(p, Partial)}
    if len(ops) > 1:
        raise ValueError(f"SBP {format_sbp(out)!r} mixes P(sum) and P(max); the reduction order between axes "
                         f"would be ambiguous — reduce one of them (to_sbp) first")
    return tuple(out)
