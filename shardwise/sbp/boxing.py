"""Boxing search (the router): the cheapest sequence of per-axis conversions between two SBP signatures. Pure data.

One mesh axis changes per step. Direct conversions on one axis of size n (bytes sent per rank, ring model,
for a local tensor of ``M`` bytes before the step):

| from → to      | collective       | bytes        | backward (conjugate)          |
|----------------|------------------|--------------|-------------------------------|
| S(i) → B       | all_gather       | (n−1)·M      | local slice                   |
| S(i) → S(j)    | all_to_all       | (n−1)/n·M    | all_to_all back               |
| S(i) → P       | zero_pad (local) | 0            | local slice                   |
| B → S(i)       | slice (local)    | 0            | all_gather                    |
| B → P(sum)     | keep_one (local) | 0            | identity                      |
| B → P(max)     | identity (local) | 0            | identity                      |
| P(op) → B      | all_reduce(op)   | 2(n−1)/n·M   | identity (sum) / argmax mask  |
| P(sum) → S(i)  | reduce_scatter   | (n−1)/n·M    | all_gather                    |

Other pairs (P(sum) ↔ P(max), P(max) → S, S → P(max)) go through B. On n-d meshes the order of the per-axis steps changes the
bytes (a gather after a reduce-scatter moves less than before it) and must respect nesting: a split of
dim ``d`` on axis ``a`` can only be created or removed while no *inner* axis also splits ``d`` (otherwise the
pieces would not be contiguous). The router runs a shortest-path search over signatures whose placements
come from {source, target, B, S(any dim)} per axis, costing each step with ``cost_fn`` (bytes by default; a calibrated
alpha–beta model can be passed), ties broken by fewer steps. Routes are cached. (``plan_boxing`` and
``BoxingPlan`` are the old names of ``route_boxing`` and ``BoxingRoute``: aliases. "The planner" is ``sw.planner``.)
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from .placement import Replicate, Partial, Placement, Split, format_sbp
from .spec import local_shape

__all__ = ["BoxingStep", "BoxingRoute", "route_boxing", "BoxingPlan", "plan_boxing", "direct_collective", "CostFn",
           "calibrated_cost"]

CostFn = Callable[[str, int, int], float]
"""``cost_fn(collective, axis_size, local_bytes_before) -> cost``; lower is better."""


@dataclass(frozen=True)
class BoxingStep:
    axis: str
    axis_index: int
    src: Placement
    dst: Placement
    collective: str
    """all_gather | all_to_all | all_reduce | reduce_scatter | slice | zero_pad | keep_one | identity"""
    bytes_sent: int
    """Bytes this rank sends in the step (ring model; 0 for local steps)."""

    def __str__(self) -> str:
        return f"{self.src} -> {self.dst}: {self.collective}(axis={self.axis})"


@dataclass(frozen=True)
class BoxingRoute:
    """The per-axis steps that convert one SBP signature into another (``route_boxing``'s answer)."""

    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    steps: tuple[BoxingStep, ...]

    @property
    def bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.steps)

    def __str__(self) -> str:
        head = f"[{format_sbp(self.src)}] -> [{format_sbp(self.dst)}]"
        return head + ("" if self.steps else ": no-op") + "".join(f"\n  {s}" for s in self.steps)


def direct_collective(src: Placement, dst: Placement) -> str | None:
    """The one-axis conversion from ``src`` to ``dst``, or None when it needs an intermediate step."""
    if src == dst:
        return None
    if isinstance(src, Split):
        return {Replicate: "all_gather", Split: "all_to_all"}.get(type(dst)) or (
            "zero_pad" if dst == Partial("sum") else None)
    if isinstance(src, Replicate):
        if isinstance(dst, Split):
            return "slice"
        return "keep_one" if dst == Partial("sum") else "identity"
    if isinstance(dst, Replicate):
        return "all_reduce"
    # A max-partial is reduce-scattered via B: its backward needs the full maximum for the argmax mask.
    return "reduce_scatter" if isinstance(dst, Split) and src == Partial("sum") else None


def bytes_model(collective: str, n: int, local_bytes: int) -> float:
    """Bytes sent per rank by a ring implementation of ``collective`` on an axis of ``n`` ranks."""
    factor = {"all_gather": n - 1, "all_to_all": (n - 1) / n, "all_reduce": 2 * (n - 1) / n,
              "reduce_scatter": (n - 1) / n}.get(collective, 0.0)
    return factor * local_bytes


def calibrated_cost(calibration, algorithm: str = "native") -> CostFn:  # type: ignore[no-untyped-def]
    """A ``cost_fn`` in microseconds from a ``shardwise bench comm --calibrate`` file's ``Calibration``.

    The calibration's models are per *full buffer* (all-reduce input, all-gather output, reduce-scatter input),
    so the local size before the step is scaled accordingly; all-to-all, which the benchmark does not measure,
    is costed like a reduce-scatter of the same buffer (both move (n−1)/n of it). Local steps cost 0. The
    calibration was measured on one group size; other axis sizes reuse its α and scale β's bytes by the ring
    factor, which is the router's assumption, not a measurement."""
    def cost(collective: str, n: int, local_bytes: int) -> float:
        if collective in ("slice", "keep_one", "identity", "zero_pad"):
            return 0.0
        op, full = {"all_gather": ("all_gather", local_bytes * n), "all_reduce": ("all_reduce", local_bytes),
                    "reduce_scatter": ("reduce_scatter", local_bytes),
                    "all_to_all": ("reduce_scatter", local_bytes)}[collective]
        return calibration.predict_us(op, algorithm, full)
    return cost


def _nesting_ok(state: Sequence[Placement], axis: int, src: Placement, dst: Placement) -> bool:
    """A split of dim d on ``axis`` may appear or vanish only when no inner axis splits d."""
    for p in (src, dst):
        if isinstance(p, Split) and any(q == p for q in state[axis + 1:]):
            return False
    return True


def route_boxing(shape: Sequence[int], itemsize: int, src: Sequence[Placement], dst: Sequence[Placement],
                 mesh_shape: Sequence[int], axes: Sequence[str], cost_fn: CostFn | None = None) -> BoxingRoute:
    """Cheapest valid route from ``src`` to ``dst``. Never communicates. Raises ``ValueError`` if none exists."""
    key_cost = cost_fn if cost_fn is not None else bytes_model
    if cost_fn is None:
        return _route_cached(tuple(shape), itemsize, tuple(src), tuple(dst), tuple(mesh_shape), tuple(axes))
    return _search(tuple(shape), itemsize, tuple(src), tuple(dst), tuple(mesh_shape), tuple(axes), key_cost)


plan_boxing = route_boxing
"""The old name of ``route_boxing``."""
BoxingPlan = BoxingRoute
"""The old name of ``BoxingRoute``."""


@lru_cache(maxsize=4096)
def _route_cached(shape, itemsize, src, dst, mesh_shape, axes) -> BoxingRoute:
    return _search(shape, itemsize, src, dst, mesh_shape, axes, bytes_model)


def _search(shape: tuple[int, ...], itemsize: int, src: tuple[Placement, ...], dst: tuple[Placement, ...],
            mesh_shape: tuple[int, ...], axes: tuple[str, ...], cost_fn: CostFn) -> BoxingRoute:
    # Intermediate placements per axis: source, target, B, and a split of any dim (a reduce-scatter before a
    # reduction on another axis shrinks what that reduction moves).
    splits = {Split(d) for d in range(len(shape))}
    options = [sorted({s, d, Replicate()} | splits, key=str) for s, d in zip(src, dst)]
    zero = (0,) * len(mesh_shape)  # coords of the first rank: it holds the largest uneven pieces
    best: dict[tuple[Placement, ...], tuple[float, int]] = {src: (0.0, 0)}
    heap: list[tuple[float, int, int, tuple[Placement, ...], tuple[BoxingStep, ...]]] = [(0.0, 0, 0, src, ())]
    tie = 0
    while heap:
        cost, nsteps, _, state, steps = heapq.heappop(heap)
        if state == dst:
            return BoxingRoute(src, dst, steps)
        if best.get(state, (math.inf, 0)) < (cost, nsteps):
            continue
        local_bytes = math.prod(local_shape(shape, state, mesh_shape, zero)) * itemsize
        for a, choices in enumerate(options):
            for p in choices:
                coll = direct_collective(state[a], p)
                if coll is None or not _nesting_ok(state, a, state[a], p):
                    continue
                step_cost = cost_fn(coll, mesh_shape[a], local_bytes)
                nxt = state[:a] + (p,) + state[a + 1:]
                key = (cost + step_cost, nsteps + 1)
                if key < best.get(nxt, (math.inf, 0)):
                    best[nxt] = key
                    step = BoxingStep(axes[a], a, state[a], p, coll, int(bytes_model(coll, mesh_shape[a], local_bytes)))
                    tie += 1
                    heapq.heappush(heap, (key[0], key[1], tie, nxt, steps + (step,)))
    raise ValueError(f"no boxing route from [{format_sbp(src)}] to [{format_sbp(dst)}] on mesh {mesh_shape}")
