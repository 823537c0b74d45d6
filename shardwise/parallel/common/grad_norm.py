"""Gradient clipping by the norm one device would compute, from gradient pieces spread over a mesh: shared by
``sw.pipeline`` (stages over pp, tp shards inside, ZeRO-1 shards over dp) and ``sw.zero`` (flat shards over dp,
tp shards inside).

Each gradient element must be counted exactly once in the global sum of ``|g|^p``:

* a parameter tied across two pipeline ranks is counted by the lower pipeline coordinate only (``skip_ids``);
* a parameter split over an axis (tensor parallelism) contributes its shard on every coordinate of it; one
  replicated over an axis (``Replicate``, or not annotated: layer norms, a row-parallel layer's bias) only on
  coordinate 0 of that axis;
* over an axis the caller owns (``own_axes``: the pipeline axis, and the dp axis of ZeRO) every coordinate
  holds different elements: a ZeRO rank's averaged shard of each flat group (``shard_pieces``), a pipeline
  rank's stages;
* without ZeRO every dp replica holds the same averaged gradient: the caller counts it on dp coordinate 0.

One all-reduce of a single number per mesh axis of size > 1; every rank then scales its own gradients by the
same ``min(1, max_norm / (norm + 1e-6))``, as ``torch.nn.utils.clip_grad_norm_`` does.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Sequence

import torch
from torch import Tensor, nn

from ... import comm
from ...mesh import Mesh
from ..tensor.apply_plan import split_axes

if TYPE_CHECKING:  # a type only: importing zero here would cycle (zero.optim clips with this module)
    from ..zero.flat import FlatGroup

__all__ = ["counted", "shard_pieces", "clip_counted"]


def counted(q: nn.Parameter, mesh: Mesh, own_axes: set[str], skip_ids: frozenset[int] | set[int]) -> bool:
    """Whether this rank counts ``q``'s gradient: not a tied copy the peer counts, and not a replica on an axis
    outside ``own_axes`` (pipeline, dp) where this rank's coordinate is not 0 (Replicate or unannotated)."""
    if id(q) in skip_ids:
        return False
    split = split_axes(q)  # layout only: a freed ZeRO stage-3 parameter has no data
    return all(axis in own_axes or axis in split or mesh.coord(axis) == 0 for axis in mesh.axes)


def shard_pieces(groups: Sequence[FlatGroup], shards: Sequence[Tensor], mesh: Mesh, axis: str,
                 own_axes: set[str], skip_ids: frozenset[int] | set[int] = frozenset()) -> list[Tensor]:
    """The views of this rank's flat gradient shards (``shards[k]``: elements ``[lo, hi)`` of group k's flat
    buffer, sharded over ``axis``) that belong to parameters this rank counts (``counted``). A parameter cut
    by the shard boundary contributes only the elements inside the shard. Local."""
    out = []
    for g, shard in zip(groups, shards):
        for k, start, stop in g.layout.pieces(mesh.coord(axis)):
            if counted(g.params[k], mesh, own_axes, skip_ids):
                at = g.layout.offsets[k] + start - g.lo  # the piece's place inside the shard
                out.append(shard[at:at + stop - start])
    return out


def _local_sum(pieces: Iterable[Tensor], p: float, device: torch.device) -> Tensor:
    """``sum |t|^p`` (``max |t|`` for p = inf) over the pieces, in float64 on ``device`` (no host sync)."""
    acc = torch.zeros((), dtype=torch.float64, device=device)
    for t in pieces:
        if t.numel() == 0:
            continue
        t = t.detach().to(device=device, dtype=torch.float64)
        acc = torch.maximum(acc, t.abs().max()) if math.isinf(p) else acc + t.abs().pow(p).sum()
    return acc


@torch.no_grad()
def clip_counted(count: list[Tensor], scale: list[Tensor], *, mesh: Mesh, max_norm: float,
                 norm_type: float) -> Tensor:
    """Scale ``scale`` in place so that the global norm is at most ``max_norm``; return the norm before (fp32).
    ``count``: the gradient pieces this rank counts (each element of the model exactly once over all ranks).
    Collective over every axis of ``mesh``: one all-reduce of one number per axis of size > 1."""
    p = float(norm_type)
    total = _local_sum(count, p, mesh.device).reshape(1)
    for ax in mesh.axes:
        if mesh.size(ax) > 1:
            comm.all_reduce(total, mesh, ax, op="max" if math.isinf(p) else "sum")
    norm = total[0] if math.isinf(p) else total[0] ** (1.0 / p)
    coef = float(torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    if coef < 1.0:
        for t in scale:
            t.mul_(coef)
    return norm.float()
