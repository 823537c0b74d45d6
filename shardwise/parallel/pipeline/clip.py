"""Gradient clipping over a whole pipelined model: the norm one device would compute, from pieces spread over
the pipeline axis (stages), tensor-parallel axes (shards) and, with ZeRO-1, the dp axis (gradient shards).

Each gradient element must be counted exactly once in the global sum of ``|g|^p``:

* a parameter tied across two pipeline ranks is counted by the lower pipeline coordinate only;
* a parameter split over an axis (tensor parallelism) contributes its shard on every coordinate of it; one
  replicated over an axis (``Broadcast``, or not annotated) only on coordinate 0 of that axis;
* with ZeRO-1 every dp replica holds the averaged shard of each bucket (the optimizer's gradient), so the
  shards are counted and the rest of the bucket is ignored; without it every replica holds the same
  averaged gradient, counted once (coordinate 0).

One all-reduce of a single number per mesh axis; every rank then scales its own gradients by the same
``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import Tensor, nn

from ... import comm
from ...mesh import Mesh
from ...sbp.placement import Split
from ..tensor.api import global_view

__all__ = ["clip_pipeline_grads"]


def counted(q: nn.Parameter, mesh: Mesh, own_axes: set[str], skip_ids: set[int]) -> bool:
    """Whether this rank counts ``q``'s gradient: not a tied copy the peer counts, and not a replica on an axis
    outside ``own_axes`` (pipeline, dp) where this rank's coordinate is not 0 (Broadcast or unannotated)."""
    if id(q) in skip_ids:
        return False
    g = global_view(q)
    for k, axis in enumerate(mesh.axes):
        if axis in own_axes or mesh.coord(axis) == 0:
            continue
        if g is None or not isinstance(g.sbp[k], Split):
            return False
    return True


def _local_sum(pieces: Iterable[Tensor], p: float) -> Tensor:
    acc = torch.zeros((), dtype=torch.float64)
    for t in pieces:
        if t.numel() == 0:
            continue
        t = t.detach().double()
        acc = torch.maximum(acc, t.abs().max().cpu()) if math.isinf(p) else acc + t.abs().pow(p).sum().cpu()
    return acc


@torch.no_grad()
def clip_pipeline_grads(count: list[Tensor], scale: list[Tensor], *, mesh: Mesh, max_norm: float,
                        norm_type: float) -> Tensor:
    """Scale ``scale`` in place so that the global norm is at most ``max_norm``; return the norm before.
    ``count``: the gradient pieces this rank counts (each element of the model exactly once over all ranks).
    Collective over every axis of ``mesh``: one all-reduce of one number per axis of size > 1."""
    p = float(norm_type)
    total = _local_sum(count, p).reshape(1).to(mesh.device)
    for ax in mesh.axes:
        if mesh.size(ax) > 1:
            comm.all_reduce(total, mesh, ax, op="max" if math.isinf(p) else "sum")
    norm = total[0] if math.isinf(p) else total[0] ** (1.0 / p)
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    if coef < 1.0:
        for t in scale:
            t.mul_(coef)
    return norm.float()
