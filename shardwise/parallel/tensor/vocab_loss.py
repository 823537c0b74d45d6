"""Vocabulary-parallel cross-entropy: the loss of vocab-sharded logits without gathering them.

Each tp rank holds logits for its vocabulary slice, ``(N, v_r)`` with ``Σ v_r = V``. The full softmax needs
only three per-row reductions across ranks (Megatron-LM's vocab-parallel cross-entropy):

    m   = max_r max_j z[r, j]                       all-reduce(max) of (N,)
    S   = Σ_r Σ_j exp(z[r, j] − m)                  ┐ one all-reduce(sum) of a stacked (2, N)
    z_y = Σ_r [y in my slice] · (z[r, y − start_r] − m)  ┘
    loss_i = log S − z_y

Two all-reduces of O(N) in forward, none in backward: the gradient of the local logits is
``softmax_local − onehot_local`` (scaled by the reduction), computed from the saved local exponentials.
Full logits (N, V) never exist on any rank.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from ...comm.collectives import all_reduce
from ...comm.ops import shard_sizes
from ...mesh import Mesh
from ...sbp.params import spec_of

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, mesh: Mesh, axis: str, start: int,
                ignore_index: int, reduction: str, algorithm: str) -> torch.Tensor:
        # (N, v_r); at least fp32 for the exp/sum (fp16/bf16 logits are promoted, fp64 kept)
        z = logits.to(torch.promote_types(logits.dtype, torch.float32))
        v_r = z.size(1)
        m = z.max(dim=1).values if v_r > 0 else z.new_full((z.size(0),), float("-inf"))
        all_reduce(m, mesh, axis, op="max", algorithm=algorithm)
        exp = (z - m[:, None]).exp()
        local_t = targets - start
        owned = (local_t >= 0) & (local_t < v_r)
        safe_t = local_t.clamp(0, max(v_r - 1, 0))[:, None]
        target_logit = (z.gather(1, safe_t).squeeze(1) - m) * owned if v_r > 0 else torch.zeros_like(m)
        both = torch.stack([exp.sum(dim=1), target_logit])  # (2, N): sum-exp and the owner's target logit
        all_reduce(both, mesh, axis, op="sum", algorithm=algorithm)
        valid = targets != ignore_index
        per_row = (both[0].log() - both[1]) * valid
        count = valid.sum()
        scale = 1.0 / count.to(z.dtype) if reduction == "mean" else torch.ones((), dtype=z.dtype, device=z.device)
        exp.div_(both[0][:, None])  # now the local softmax
        ctx.save_for_backward(exp, safe_t, owned & valid, valid, scale)
        ctx.dtype = logits.dtype
        return (per_row.sum() * scale).to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, safe_t, hit, valid, scale = ctx.saved_tensors
        grad = softmax * valid[:, None]
        if grad.size(1) > 0:
            grad.scatter_add_(1, safe_t, -hit.to(grad.dtype)[:, None])
        grad.mul_(g.to(grad.dtype) * scale)
        return grad.to(ctx.dtype), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor, *, mesh: Mesh, axis: str = "tp",
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 reduction: Literal["mean", "sum"] = "mean", algorithm: str = "native") -> torch.Tensor:
    """Cross-entropy of logits split over ``axis`` on the last dim, equal to ``F.cross_entropy`` of the full
    logits (same ``ignore_index`` and ``reduction`` semantics), with every full-vocab tensor avoided.

    ``local_logits``: ``(..., v_r)``, this rank's vocabulary slice (``shard_sizes(V, tp)`` rule: rank r holds
    ids ``[Σ_{q<r} v_q, ...)``); ``targets``: ``(...)`` full token ids, the same on every tp rank.
    ``vocab_size``: V; may be omitted when ``local_logits`` comes straight from a ``VocabParallel`` LM head
    (its output carries its global shape). Returns the replicated scalar loss. Collective over ``axis``
    (two all-reduces in forward, none in backward).
    """
    if local_logits.shape[:-1] != targets.shape:
        raise ValueError(f"local_logits {tuple(local_logits.shape)} and targets {tuple(targets.shape)} disagree; "
                         f"logits must be targets.shape + (local vocab,)")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    n, coord = mesh.size(axis), mesh.coord(axis)
    if vocab_size is None:
        spec = spec_of(local_logits)
        if spec is None:
            raise ValueError("vocab_size is unknown: these logits do not come straight from a VocabParallel head "
                             "(a reshape drops that); pass vocab_size=V")
        vocab_size = spec.shape[-1]
    sizes = shard_sizes(vocab_size, n)
    if local_logits.size(-1) != sizes[coord]:
        raise ValueError(f"local_logits have {local_logits.size(-1)} vocabulary columns but tp rank {coord} of {n} "
                         f"owns {sizes[coord]} of vocab_size={vocab_size} (shard_sizes rule); check vocab_size")
    start = sum(sizes[:coord])
    flat = local_logits.reshape(targets.numel(), local_logits.size(-1))
    return _VocabParallelCE.apply(flat, targets.reshape(-1), mesh, axis, start, ignore_index, reduction, algorithm)
