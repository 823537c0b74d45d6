"""Moving tokens to their experts and back: the permutation on one rank, and the all-to-all between the ranks
of an expert-parallel axis.

An MoE layer gives ``route`` the (N, h) tokens and their (N, k) chosen experts; ``route`` runs
``experts(x_sorted, counts)`` on rows grouped by expert and returns each assignment's output as (N, k, h), in
the order of the assignments, so the caller's weighted sum over k is the same on every layout (a fixed order,
no scatter-add). Dropped assignments (capacity) are marked with expert id ``-1`` and come back as zeros.

Under expert parallelism (``ExpertShard``) the ``E`` experts are split in ``ep`` contiguous blocks of ``E / ep``
(block ``i`` on the axis coordinate ``i``). The tokens go out in expert order, so the rows for rank ``r`` are one
contiguous run; the per-expert counts travel first (one all-to-all of ``ep × E/ep`` ints), the tokens second
(rows uneven per rank), then the received rows — grouped by source rank, then expert — are regrouped by expert
for the grouped matmul; the way back is the same in reverse, and autograd runs both all-to-alls again in
backward (``comm.alltoall``). An expert that receives no token runs a zero-row matmul: its gradient is zero,
never missing.

Replicated tokens (``ExpertShard(..., replicated=True)``, what ``sw.ExpertParallel`` sets): every rank of the
axis holds the same tokens (a tensor-parallel axis), so nothing travels to the experts; each rank runs only the
assignments of its own block (the others come back as zeros) and the (N, k, h) outputs are summed over the axis
(forward all-reduce, backward identity), the input's gradient summed in backward (the Megatron pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from ...mesh import Mesh

__all__ = ["ExpertShard", "route", "regroup_index", "local_ids"]

ExpertsFn = Callable[[Tensor, list[int]], Tensor]
"""``experts(x, counts)``: rows of ``x`` (M, h) grouped by local expert, ``counts[j]`` rows for expert j → (M, h)."""


@dataclass(frozen=True)
class ExpertShard:
    """This rank's block of experts under expert parallelism: the ``axis`` of ``mesh`` splits ``n_experts``
    in ``mesh.size(axis)`` contiguous blocks. ``algorithm``: the all-to-all's (``comm.alltoall``)."""

    mesh: Mesh
    axis: str
    n_experts: int
    algorithm: str = "native"
    replicated: bool = False
    """Whether the ranks of ``axis`` hold the same tokens (see the module docstring) rather than different ones."""

    @property
    def size(self) -> int:
        return self.mesh.size(self.axis)

    @property
    def local(self) -> int:
        """Experts per rank."""
        return self.n_experts // self.size

    @property
    def first(self) -> int:
        """Global id of this rank's first expert."""
        return self.mesh.coord(self.axis) * self.local


def route(x: Tensor, experts_of: Tensor, n_experts: int, experts: ExpertsFn,
          shard: ExpertShard | None = None) -> Tensor:
    """Each assignment's expert output: ``x`` (N, h), ``experts_of`` (N, k) int64 expert ids (``-1``: dropped)
    → (N, k, h). ``shard``: None runs every expert here; else the experts live on ``shard``'s axis and the
    tokens travel there and back (collective over that axis: every rank must call, tokens or not)."""
    if shard is not None and shard.replicated:
        return _replicated(x, experts_of, experts, shard)
    n, k = experts_of.shape
    flat = experts_of.reshape(-1)  # (N·k,) assignment a is token a // k
    kept = (flat >= 0).nonzero().squeeze(1)
    order = kept[torch.argsort(flat[kept], stable=True)]  # kept assignments, by expert then by position
    rows = x.index_select(0, torch.div(order, k, rounding_mode="floor"))  # (A, h) in expert order
    counts = torch.bincount(flat[order], minlength=n_experts)  # (E,)
    if shard is None:
        out = experts(rows, counts.tolist())
    else:
        out = _across(rows, counts, experts, shard)
    full = x.new_zeros(n * k, x.size(1))
    full = full.index_copy(0, order, out)  # every kept assignment written once: deterministic
    return full.view(n, k, x.size(1))


def local_ids(experts_of: Tensor, first: int, local: int) -> Tensor:
    """Global expert ids → ids within the block ``[first, first + local)``; ``-1`` outside it (and for ``-1``)."""
    ids = experts_of - first
    return torch.where((experts_of >= 0) & (ids >= 0) & (ids < local), ids, torch.full_like(ids, -1))


def _replicated(x: Tensor, experts_of: Tensor, experts: ExpertsFn, shard: ExpertShard) -> Tensor:
    """``route`` over an axis whose ranks hold the same ``x``: this rank's experts' outputs, summed over the
    axis (one all-reduce of (N, k, h) forward, one of the input's gradient backward)."""
    from ...comm.autograd import allreduce_identity, identity_allreduce  # noqa: PLC0415 (comm layer, below)

    x = identity_allreduce(x, shard.mesh, shard.axis, algorithm=shard.algorithm)
    out = route(x, local_ids(experts_of, shard.first, shard.local), shard.local, experts)
    return allreduce_identity(out, shard.mesh, shard.axis, algorithm=shard.algorithm)


def _across(rows: Tensor, counts: Tensor, experts: ExpertsFn, shard: ExpertShard) -> Tensor:
    """``rows`` (A, h) in global expert order with ``counts`` (E,) → their outputs (A, h), the experts run on
    the ranks of ``shard``'s axis. Two all-to-alls of counts (a few ints) and two of rows, forward."""
    from ...comm.alltoall import all_to_all_autograd, exchange_counts  # noqa: PLC0415 (comm layer, below)

    p, local = shard.size, shard.local
    sent = counts.view(p, local)  # sent[r, j]: rows for rank r's expert j
    got = exchange_counts(sent.reshape(-1), shard.mesh, shard.axis).view(p, local)  # got[s, j]: from rank s
    sent_l, got_l = sent.tolist(), got.tolist()  # one host read for the split sizes
    send_splits = [sum(r) for r in sent_l]
    recv_splits = [sum(r) for r in got_l]
    arrived = all_to_all_autograd(rows, shard.mesh, shard.axis, out_splits=recv_splits, in_splits=send_splits,
                                  algorithm=shard.algorithm)  # (R, h): by source rank, then expert
    index = regroup_index(got_l, rows.device)  # by expert, then source rank
    per_expert = [sum(got_l[s][j] for s in range(p)) for j in range(local)]
    done = experts(arrived.index_select(0, index), per_expert)
    back = torch.empty_like(done).index_copy(0, index, done)  # by source rank again
    return all_to_all_autograd(back, shard.mesh, shard.axis, out_splits=send_splits, in_splits=recv_splits,
                               algorithm=shard.algorithm)


def regroup_index(got: list[list[int]], device: torch.device) -> Tensor:
    """Row order that turns blocks laid ``[source][expert]`` (``got[s][j]`` rows each) into ``[expert][source]``:
    position ``i`` of the result is the source row that goes to place ``i``. Pure."""
    p, local = len(got), len(got[0]) if got else 0
    starts, at = [[0] * local for _ in range(p)], 0
    for s in range(p):
        for j in range(local):
            starts[s][j], at = at, at + got[s][j]
    pieces = [torch.arange(starts[s][j], starts[s][j] + got[s][j], device=device)
              for j in range(local) for s in range(p)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=device)
