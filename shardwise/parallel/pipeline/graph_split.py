"""Where a captured graph is cut: checking ``split`` names, and balancing stages by the leaves' forward FLOPs.

Pure except ``flops_per_leaf``, which counts during the capture run (``torch.utils.flop_counter``: matmuls,
convolutions, attention — the same count on every rank, so every rank cuts the same stages).
"""

from __future__ import annotations

import difflib
from contextlib import contextmanager
from typing import Iterator, Sequence

from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .capture import Graph
from .stage import balance_by_params

__all__ = ["check_split", "flops_per_leaf", "resolve_starts"]


def check_split(model: nn.Module, leaves: dict[str, nn.Module], split: Sequence[str] | None, n: int) -> None:
    """``ValueError``/``TypeError`` for split names that are not modules or cannot start a stage (before capture)."""
    if split is None:
        return
    if isinstance(split, str):
        raise TypeError(f"split must be a list of module names, got the string {split!r}; use [{split!r}]")
    names = dict(model.named_modules())
    for name in split:
        if name not in names:
            near = difflib.get_close_matches(str(name), list(leaves), n=3)
            hint = f"; did you mean {' or '.join(map(repr, near))}?" if near else ""
            raise ValueError(f"pipeline split name {name!r} is not a module of {type(model).__name__}{hint} "
                             f"(a stage starts at a module: one of {_sample(leaves)})")
        if name not in leaves:
            raise ValueError(f"pipeline split name {name!r} is a container of other cut points, not a module a stage "
                             f"can start at; name one of its layers, e.g. {_sample(leaves, prefix=name + '.')}")
    if len(split) != n - 1:
        raise ValueError(f"pipeline split {list(split)} makes {len(split) + 1} stages but the mesh axis and chunks "
                         f"need pp x chunks = {n}; give {n - 1} names")


def _sample(leaves: dict[str, nn.Module], prefix: str = "") -> str:
    names = [n for n in leaves if n.startswith(prefix)]
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


@contextmanager
def flops_per_leaf(leaves: dict[str, nn.Module]) -> Iterator[dict[str, float]]:
    """Forward FLOPs of each leaf's calls during the ``with`` block (summed over repeated calls)."""
    counts: dict[str, float] = {name: 0.0 for name in leaves}
    mode = FlopCounterMode(display=False)
    starts: dict[str, int] = {}
    handles = []
    for name, module in leaves.items():
        handles.append(module.register_forward_pre_hook(
            lambda *_, n=name: starts.__setitem__(n, mode.get_total_flops())))
        handles.append(module.register_forward_hook(
            lambda *_, n=name: counts.__setitem__(n, counts[n] + mode.get_total_flops() - starts[n])))
    try:
        with mode:
            yield counts
    finally:
        for h in handles:
            h.remove()


def _units(graph: Graph, leaves: dict[str, nn.Module]) -> list[list[str]]:
    """Leaves in call order, grouped so that each group starts with a leaf that owns parameters."""
    units: list[list[str]] = []
    for name in graph.leaf_order:
        has = next(leaves[name].parameters(), None) is not None
        if has or not units:
            units.append([name])
        else:
            units[-1].append(name)
    return units


def resolve_starts(model: nn.Module, graph: Graph, leaves: dict[str, nn.Module], split: Sequence[str] | None,
                   n: int, flops: dict[str, float]) -> list[str]:
    """The leaf names that start stages 1..n-1 (given, or balanced by FLOPs); ``ValueError`` for a bad cut."""
    order = graph.leaf_order
    if split is not None:
        missing = [s for s in split if s not in order]
        if missing:
            raise ValueError(f"pipeline split {missing} names modules the forward never calls on the example inputs; "
                             f"cut at a module it runs, e.g. {', '.join(order[1:5])}")
        pos = [order.index(s) for s in split]
        if any(b <= a for a, b in zip([0, *pos], pos)):
            raise ValueError(f"pipeline split {list(split)} is not in forward order after the first module "
                             f"{order[0]!r}, or leaves a stage empty; the forward runs {', '.join(order[:8])}, ...")
        _check_params(leaves, order, pos, split)
        return list(split)
    units = _units(graph, leaves)
    if len(units) < n:
        raise ValueError(f"the model has {len(units)} modules with parameters to cut between "
                         f"({[u[0] for u in units]}) but pp x chunks = {n} stages need at least {n}")
    weights = [sum(flops.get(x, 0.0) for x in u) for u in units]
    if sum(weights) == 0:  # no matmuls counted: fall back to parameter counts
        weights = [sum(q.numel() for x in u for q in leaves[x].parameters()) for u in units]
    starts = balance_by_params([max(1, int(w)) for w in weights], n)
    return [units[i][0] for i in starts[1:]]


def _check_params(leaves: dict[str, nn.Module], order: list[str], pos: list[int], split: Sequence[str]) -> None:
    bounds = list(zip([0, *pos], [*pos, len(order)]))
    for s, (a, b) in enumerate(bounds):
        if not any(next(leaves[x].parameters(), None) is not None for x in order[a:b]):
            raise ValueError(f"pipeline split {list(split)} leaves stage {s} ({', '.join(order[a:b])}) without "
                             f"parameters; move that boundary so every stage holds a layer")
