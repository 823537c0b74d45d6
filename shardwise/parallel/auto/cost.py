"""Prices for ``sw.auto``: compute, the boxing conversions the executors perform, gradient all-reduce, memory.

Every conversion is priced by the project's boxing router (``sbp.boxing.route_boxing``) on the real mesh
shape, with a ``cost_fn`` in seconds from the hardware's alpha–beta collective model. ``hardware`` is anything
with ``collective_time(op, nbytes, size, algorithm=)``, ``gemm_time(m, n, k, dtype=, elem_bytes=)`` and
``memory_time(nbytes, ops)`` — ``sw.planner.Hardware.preset(...)`` or ``Hardware.load("calibration.json")``
(this package sits below the planner, so it takes the object rather than importing it). Without one,
``NominalHardware`` uses the mesh's attached collective calibrations (``Mesh(calibration=...)``, which the
trainer attaches from ``shardwise calibrate``) where it has one for the group size, and nominal constants
otherwise — good for ranking layouts, not for predicting seconds.

Pure: no processes, no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from ...sbp.boxing import route_boxing
from ...sbp.placement import Replicate, Partial, Placement, Split
from ...sbp.spec import local_shape

__all__ = ["HardwareLike", "NominalHardware", "CostModel", "STATE_COPIES", "BUCKET_BYTES"]

STATE_COPIES = 4
"""Copies of each parameter a rank keeps while training: the weight, its gradient, two Adam moments."""
BUCKET_BYTES = 25 * 2**20
"""``DataParallel``'s default bucket: gradient all-reduces are priced per bucket, latency shared by its bytes."""


class HardwareLike(Protocol):
    def collective_time(self, op: str, nbytes: float, size: int, *, algorithm: str = ...) -> float: ...
    def gemm_time(self, m: float, n: float, k: float, *, dtype: str, elem_bytes: int = ...) -> float: ...
    def memory_time(self, nbytes: float, ops: float = ...) -> float: ...


@dataclass(frozen=True)
class NominalHardware:
    """Round numbers for one device and its link, plus measured collective models by group size."""

    flops: float = 1e11
    memory_bandwidth_Bps: float = 2e10
    op_overhead_s: float = 5e-6
    alpha_s: float = 2e-5
    """Latency per ring step."""
    bus_bandwidth_Bps: float = 5e9
    calibrations: Mapping[int, Any] = field(default_factory=dict)
    """``comm.calibration.Calibration`` by group size (its ``native`` models are used)."""

    def collective_time(self, op: str, nbytes: float, size: int, *, algorithm: str = "native") -> float:
        if size <= 1 or nbytes <= 0:
            return 0.0
        cal = self.calibrations.get(size)
        if cal is not None and op in cal.models:
            algo = algorithm if algorithm in cal.models[op] else cal.best_algorithm(op, nbytes)
            return cal.predict_us(op, algo, nbytes) * 1e-6
        factor = 2.0 if op == "all_reduce" else 1.0
        return factor * (size - 1) * (self.alpha_s + nbytes / size / self.bus_bandwidth_Bps)

    def gemm_time(self, m: float, n: float, k: float, *, dtype: str = "fp32", elem_bytes: int = 4) -> float:
        traffic = elem_bytes * (m * k + k * n + m * n) / self.memory_bandwidth_Bps
        return max(2.0 * m * n * k / self.flops, traffic) + self.op_overhead_s

    def memory_time(self, nbytes: float, ops: float = 0.0) -> float:
        return nbytes / self.memory_bandwidth_Bps + ops * self.op_overhead_s


_FULL = {"all_gather": lambda b, n: b * n, "all_reduce": lambda b, n: b, "reduce_scatter": lambda b, n: b,
         "all_to_all": lambda b, n: b}
_OP = {"all_to_all": "reduce_scatter"}  # moves (n-1)/n of the buffer, like a reduce-scatter


@dataclass(frozen=True)
class CostModel:
    """Prices on one mesh for one choice of tensor-parallel axis (``tp``; None: every axis carries data)."""

    hardware: Any
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    tp: str | None
    itemsize: int
    dtype: str
    """``fp32`` or ``bf16``: the hardware's compute precision name."""

    @property
    def t(self) -> int:
        return 1 if self.tp is None else self.shape[self.axes.index(self.tp)]

    @property
    def d(self) -> int:
        """Data-parallel ranks (product of every non-tp axis)."""
        return math.prod(s for a, s in zip(self.axes, self.shape) if a != self.tp)

    def _cost_fn(self, collective: str, n: int, local_bytes: int) -> float:
        if collective not in _FULL:
            return 0.0  # local steps: slice, keep_one, zero_pad, identity
        op = _OP.get(collective, collective)
        return self.hardware.collective_time(op, _FULL[collective](local_bytes, n), n, algorithm="native")

    def boxing(self, shape: Sequence[int], src: Sequence[Placement], dst: Sequence[Placement]) -> float:
        """Seconds of the cheapest conversion ``src -> dst`` of a logical tensor of ``shape`` (boxing router)."""
        plan = route_boxing(tuple(shape), self.itemsize, tuple(src), tuple(dst), self.shape, self.axes,
                           cost_fn=self._cost_fn)
        return sum(self._cost_fn(s.collective, self.shape[s.axis_index], _local(s, shape, plan, self))
                   for s in plan.steps)

    def sbp(self, tp_placement: Placement, batch_dim: int | None = 0) -> tuple[Placement, ...]:
        """An activation's signature: split on ``batch_dim`` over the data axes, ``tp_placement`` on tp."""
        data = Split(batch_dim) if batch_dim is not None else Replicate()
        return tuple(tp_placement if a == self.tp else (data if s > 1 else Replicate())
                     for a, s in zip(self.axes, self.shape))

    def reduce_over_tp(self, shape: Sequence[int]) -> float:
        """A partial activation made whole on the tp axis (P -> B), batch split over the data axes."""
        if self.t == 1:
            return 0.0
        return self.boxing(shape, self.sbp(Partial()), self.sbp(Replicate()))

    def grad_allreduce(self, nbytes: float) -> float:
        """Gradients of ``nbytes`` (this rank's piece) made whole over the data axes, in full buckets."""
        if self.d == 1 or nbytes <= 0:
            return 0.0
        numel = BUCKET_BYTES // self.itemsize
        tp_part = {self.tp} if self.tp else set()
        src = tuple(Replicate() if a in tp_part or s == 1 else Partial() for a, s in zip(self.axes, self.shape))
        per_bucket = self.boxing((numel,), src, (Replicate(),) * len(self.axes))
        return per_bucket * nbytes / BUCKET_BYTES

    def gemm(self, m: float, n: float, k: float) -> float:
        """Forward plus backward (two GEMMs of the same size) of ``(m, k) @ (k, n)``."""
        if min(m, n, k) <= 0:
            return 0.0
        return 3 * self.hardware.gemm_time(m, n, k, dtype=self.dtype, elem_bytes=self.itemsize)

    def elementwise(self, nbytes: float) -> float:
        """A memory-bound op on ``nbytes`` of output, forward and backward (read, write, and twice back)."""
        return self.hardware.memory_time(4 * nbytes, 2)


def _local(step: Any, shape: Sequence[int], plan: Any, model: CostModel) -> int:
    """Local bytes before ``step`` of the boxing route ``plan`` (the router's rank-0 pieces)."""
    state = list(plan.src)
    for s in plan.steps:
        if s is step:
            break
        state[s.axis_index] = s.dst
    zero = (0,) * len(model.shape)
    return math.prod(local_shape(tuple(shape), tuple(state), model.shape, zero)) * model.itemsize
