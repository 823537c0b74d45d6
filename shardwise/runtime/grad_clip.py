"""Gradient clipping of ``shardwise train`` (``optimizer.clip_grad_norm``): the L2 norm of the whole model's
gradient, computed from the pieces a layout spreads over the mesh as one device computes it over the whole model,
and ``torch.nn.utils.clip_grad_norm_``'s scaling (``coef = max_norm / (norm + 1e-6)``, applied when ``coef < 1``)
of every gradient tensor the optimizer reads. Each ``Strategy.clip_grad_norm`` picks the pieces; this module
sums, reduces and scales them.

Every gradient element of the model is counted exactly once over all ranks (the rule of
``parallel/common/grad_norm.counted``, which reads a parameter's placement from its SBP spec):

* tp: a parameter ``Split`` over tp counts its shard on every tp rank; one replicated over tp (``Replicate`` or
  no spec: layer norms, a row-parallel bias, ``parallel.replicate``'d modules) only on tp coordinate 0;
* dp without ZeRO: every replica holds the same averaged gradient, bitwise (every all-reduce algorithm leaves the
  same bytes on each rank — the replicas' weights stay equal only because of it), so each replica counts all of it
  locally and gets the same norm without any dp reduction;
* ZeRO (``sw.zero`` stages 1-3, a pipeline's ZeRO-1): this rank's averaged shard of each flat group;
* pp: each rank its own stages; a weight tied across two pipeline ranks (embedding and head, identical summed
  gradients after the pipeline's tied exchange) only on the lower pipeline coordinate;
* ep (experts of an MoE block split over the ``ep`` axis of the expert mesh, ``runtime/experts.py``): each ep
  rank's piece is a different part of the expert weights, averaged and identical over ``edp`` and ``tp``. It counts
  on tp coordinate 0 (replicated over tp); where the dense part is not reduced over dp (plain dp) its squares are
  summed over ``ep`` first (``ExpertNorm``, one more all-reduce of one number); under ZeRO, whose dp reduction
  spans ``edp × ep``, they count on edp coordinate 0 only and ride along with the dense shards.

Cost per step, only when clipping is on: one fused local reduction (``torch._foreach_norm`` per tensor, fp32
accumulation, then one sum of their squares), one ``sum`` all-reduce of one fp32 number per mesh axis whose
ranks hold different pieces (``axes``; plain and dp: none; tp, dp×tp, ZeRO, pp, pp×dp: one; ZeRO×tp, pp×tp and
pp×dp with ZeRO-1: two; pp×dp×tp with ZeRO-1: three) and one host read of the norm (the logged value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from torch import Tensor, nn

from ..comm.collectives import all_reduce
from ..mesh import Mesh
from ..parallel.common.grad_norm import counted

__all__ = ["counted_grads", "local_sum_of_squares", "global_norm", "clip_", "ExpertNorm"]


@dataclass(frozen=True)
class ExpertNorm:
    """Gradient pieces whose squares are summed over ``axes`` of ``mesh`` (the expert mesh's ``ep``) before they
    join the layout's own reduction (``clip_``'s ``axes``): expert pieces under plain data parallelism."""

    count: Sequence[Tensor]
    mesh: Mesh
    axes: Sequence[str]


def counted_grads(params: Iterable[nn.Parameter], mesh: Mesh, own_axes: set[str],
                  skip_ids: frozenset[int] | set[int] = frozenset()) -> list[Tensor]:
    """The ``.grad`` of each parameter this rank counts (``counted``): ``own_axes`` are the axes over which every
    coordinate counts its gradient (pp: different stages; dp without ZeRO: identical replicas, never reduced);
    over the other axes (tp) a parameter counts on every coordinate only if it is split there. Local."""
    return [q.grad for q in params if q.grad is not None and counted(q, mesh, own_axes, skip_ids)]


def local_sum_of_squares(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """``sum |g|^2`` over every element of ``tensors``, fp32, shape ``(1,)`` on ``device``: one multi-tensor
    launch of per-tensor L2 norms accumulated in fp32 (bf16 gradients too), then one sum of their squares (the
    per-tensor grouping ``torch.nn.utils.clip_grad_norm_`` uses). No host sync. Local."""
    live = [t.detach() for t in tensors if t.numel()]
    if not live:
        return torch.zeros(1, dtype=torch.float32, device=device)
    norms = torch._foreach_norm(live, 2, dtype=torch.float32)  # one 0-d fp32 norm per tensor
    return torch.stack(norms).to(device).square().sum().reshape(1)


def global_norm(local: Tensor, mesh: Mesh, axes: Iterable[str]) -> Tensor:
    """The global L2 norm from each rank's ``local`` sum of squares ``(1,)`` (reduced in place): one ``sum``
    all-reduce per axis of ``axes`` that the mesh has with size > 1, then the square root. Collective over
    those axes."""
    for axis in axes:
        if axis in mesh.axes and mesh.size(axis) > 1:
            all_reduce(local, mesh, axis, op="sum")
    return local.sqrt()


@torch.no_grad()
def clip_(count: Sequence[Tensor], scale: Sequence[Tensor], mesh: Mesh, axes: Iterable[str],
          max_norm: float, experts: ExpertNorm | None = None) -> float:
    """Clip to ``max_norm`` as ``torch.nn.utils.clip_grad_norm_`` does on one device; returns the global norm
    before clipping. ``count``: the gradient pieces this rank counts (each element of the model exactly once over
    all ranks); ``scale``: every gradient tensor the optimizer reads on this rank (scaled in place by the same
    fp32 ``coef`` on every rank); ``axes``: those over which ranks hold different pieces; ``experts``:
    pieces first summed over their own axes (``ExpertNorm``; in ``scale`` too). Collective over ``axes`` (one
    all-reduce of one number each, and one per axis of ``experts``), one host read."""
    if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm = {max_norm!r} must be a finite number > 0; e.g. clip_(..., max_norm=1.0)")
    local = local_sum_of_squares(count, mesh.device)
    if experts is not None:
        local = local + global_norm(local_sum_of_squares(experts.count, mesh.device), experts.mesh,
                                    experts.axes).square()  # the ep pieces' squares, summed over ep
    norm = global_norm(local, mesh, axes)[0]
    coef = max_norm / (norm + 1e-6)  # 0-d fp32, the expression torch evaluates
    value, factor = torch.stack([norm, coef]).tolist()  # the one host read (the trainer logs the norm)
    live = [t for t in scale if t.numel()]
    if factor < 1.0 and live:
        torch._foreach_mul_(live, coef)
    return value
