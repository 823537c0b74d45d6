"""Exact minimum-cost layout of a traced graph: dynamic programming over its live frontier.

Nodes are visited in call order (a topological order: a node's inputs come from earlier nodes). The state
after node ``i`` is the option chosen for every *live* node — one visited but with a consumer still to come.
A choice is feasible when every input is delivered as the consumer needs it (``Option.gives`` vs ``need``);
total cost is the sum of node costs (every transition ``sw.parallelize`` performs is priced inside the nodes).
On a chain the frontier is one node and this is the textbook chain DP; a transformer's frontier is the
residual stream plus the open branch (q, k, v before attention: four nodes), so the states stay few. The
search is exact as long as the number of states stays under ``max_states``; beyond it only the cheapest
``max_states`` states are kept (a beam: a heuristic, ``Solution.exact`` is False; its gap against brute
force is measured in ``tests/unit/test_auto_solve.py``).

With a memory budget each state keeps its Pareto set of (time, memory) — memory is a sum over nodes too —
and points over the budget are dropped, so the answer is the fastest plan that fits, still exact.

Pure: no processes, no communication.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from .options import Option

__all__ = ["Solution", "NoFit", "solve", "brute_force"]


@dataclass(frozen=True)
class Solution:
    choice: tuple[int, ...]
    """Option index per node."""
    time_s: float
    memory: float
    exact: bool


class NoFit(ValueError):
    """No feasible layout within the memory budget (``min_memory``: the smallest predicted footprint)."""

    def __init__(self, min_memory: float) -> None:
        super().__init__(f"no layout fits; the smallest predicted footprint is {min_memory:.0f} bytes")
        self.min_memory = min_memory


def _feasible(o: Option, got: Sequence[Option]) -> bool:
    return o.need == "any" or all(g.gives == o.need for g in got)


def _last_use(preds: Sequence[Sequence[int]]) -> list[int]:
    last = list(range(len(preds)))
    for v, ps in enumerate(preds):
        for u in ps:
            last[u] = max(last[u], v)
    return last


Point = tuple[float, float, object]  # (time, memory, link to (previous link, option index))


def _insert(points: list[Point], new: Point, pareto: bool) -> list[Point]:
    if not pareto:
        return [new] if not points or (new[0], new[1]) < (points[0][0], points[0][1]) else points
    if any(p[0] <= new[0] and p[1] <= new[1] for p in points):
        return points
    return [p for p in points if not (new[0] <= p[0] and new[1] <= p[1])] + [new]


def _step(states: dict, v: int, opts: Sequence[Option], preds: Sequence[int], live_after: set[int],
          budget: float | None) -> dict:
    """States after node ``v``. A state key is ``((node, gives), ...)`` over live nodes: the future depends
    on what a live node delivers, not on which option delivered it."""
    nxt: dict = {}
    for key, points in states.items():
        gives = dict(key)
        for j, o in enumerate(opts):
            if o.need != "any" and any(gives[u] != o.need for u in preds):
                continue
            new_key = tuple((u, g) for u, g in sorted({**gives, v: o.gives}.items()) if u in live_after)
            bucket = nxt.setdefault(new_key, [])
            for t, m, link in points:
                if budget is not None and m + o.memory > budget:
                    continue
                bucket[:] = _insert(bucket, (t + o.time_s, m + o.memory, (link, j)), budget is not None)
    return {k: p for k, p in nxt.items() if p}


def _prune(states: dict, max_states: int) -> tuple[dict, bool]:
    if len(states) <= max_states:
        return states, True
    ranked = sorted(states.items(), key=lambda kv: min(p[0] for p in kv[1]))
    return dict(ranked[:max_states]), False


def solve(options: Sequence[Sequence[Option]], preds: Sequence[Sequence[int]], budget: float | None = None,
          max_states: int = 20000) -> Solution:
    """The cheapest feasible choice; ``NoFit`` (with the smallest footprint) when the budget excludes all,
    ``ValueError`` when no choice is feasible at all."""
    last = _last_use(preds)
    states: dict = {(): [(0.0, 0.0, None)]}
    exact = True
    for v, opts in enumerate(options):
        live_after = {u for u in range(v + 1) if last[u] > v}
        states = _step(states, v, opts, preds[v], live_after, budget)
        states, kept_all = _prune(states, max_states)
        exact = exact and kept_all
        if not states:
            break
    finals = [p for points in states.values() for p in points]
    if not finals:
        if budget is not None:
            raise NoFit(min_memory(options, preds, max_states))
        raise ValueError("no feasible layout: the traced graph's pins or options contradict each other")
    t, m, link = min(finals, key=lambda p: (p[0], p[1]))
    return Solution(_unwind(link, len(options)), t, m, exact)


def _unwind(link: object, n: int) -> tuple[int, ...]:
    out: list[int] = []
    while link is not None:
        link, j = link  # type: ignore[misc]
        out.append(j)
    assert len(out) == n, (len(out), n)
    return tuple(reversed(out))


def min_memory(options: Sequence[Sequence[Option]], preds: Sequence[Sequence[int]], max_states: int) -> float:
    """The smallest footprint of any feasible layout (the same DP with memory as the cost)."""
    swapped = [[Option(o.kind, o.style, o.need, o.gives, o.memory, o.time_s) for o in opts] for opts in options]
    return solve(swapped, preds, None, max_states).time_s


def brute_force(options: Sequence[Sequence[Option]], preds: Sequence[Sequence[int]],
                budget: float | None = None) -> Solution | None:
    """Every combination (for tests on small graphs); None when nothing is feasible."""
    best: Solution | None = None
    for choice in itertools.product(*(range(len(o)) for o in options)):
        chosen = [options[v][j] for v, j in enumerate(choice)]
        if not all(_feasible(o, [chosen[u] for u in preds[v]]) for v, o in enumerate(chosen)):
            continue
        t, m = sum(o.time_s for o in chosen), sum(o.memory for o in chosen)
        if budget is not None and m > budget:
            continue
        if best is None or (t, m) < (best.time_s, best.memory):
            best = Solution(choice, t, m, True)
    return best if best is not None else None
