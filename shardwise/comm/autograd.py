"""Differentiable collectives: each forward collective next to its autograd conjugate.

The pairs are the ``f``/``g`` operators of Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", §3) and their sequence-parallel
extension (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"):

| function                     | forward                 | backward                |
|------------------------------|-------------------------|-------------------------|
| ``allreduce_identity``       | all-reduce (sum): P → B | identity                |
| ``identity_allreduce``       | identity                | all-reduce (sum)        |
| ``allgather_reducescatter``  | all-gather: S → B       | reduce-scatter: P → S   |
| ``reducescatter_allgather``  | reduce-scatter: P → S   | all-gather              |
| ``split_allgather``          | local slice: B → S      | all-gather              |
| ``allgather_split``          | all-gather: S → B       | local slice             |

Why two gathers: the backward of an all-gather is a reduce-scatter when every rank's downstream graph holds a
*partial* gradient of the gathered tensor (sequence parallelism), and a plain local slice when every rank
computes the *same* gradient (replicated downstream). Every function is collective over ``axis`` in forward
and in backward. Uneven splits follow ``shard_sizes``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..mesh import Mesh
from .collectives import all_gather, all_reduce, reduce_scatter
from .ops import shard_sizes

__all__ = ["allreduce_identity", "identity_allreduce", "allgather_reducescatter", "reducescatter_allgather",
           "split_allgather", "allgather_split", "local_slice"]


def local_slice(x: torch.Tensor, mesh: Mesh, axis: str, dim: int) -> torch.Tensor:
    """This rank's piece of ``x`` along ``dim`` under the ``shard_sizes`` rule (no communication)."""
    sizes = shard_sizes(x.shape[dim], mesh.size(axis))
    return torch.split(x, sizes, dim=dim)[mesh.coord(axis)].contiguous()


class _AllReduceIdentity(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, algorithm: str) -> torch.Tensor:
        out = x.clone()
        all_reduce(out, mesh, axis, op="sum", algorithm=algorithm)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return g, None, None, None


class _IdentityAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, algorithm: str) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.algorithm = mesh, axis, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        g = g.clone()
        all_reduce(g, ctx.mesh, ctx.axis, op="sum", algorithm=ctx.algorithm)
        return g, None, None, None


class _AllGatherReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, dim: int, sizes: list[int] | None,
                algorithm: str) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.dim, ctx.algorithm = mesh, axis, dim, algorithm
        return all_gather(x, mesh, axis, dim=dim, sizes=sizes, algorithm=algorithm)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        gx = reduce_scatter(g.contiguous(), ctx.mesh, ctx.axis, op="sum", dim=ctx.dim, algorithm=ctx.algorithm)
        return gx, None, None, None, None, None


class _ReduceScatterAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, dim: int, algorithm: str) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.dim, ctx.algorithm = mesh, axis, dim, algorithm
        ctx.sizes = shard_sizes(x.shape[dim], mesh.size(axis))
        return reduce_scatter(x, mesh, axis, op="sum", dim=dim, algorithm=algorithm)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        gx = all_gather(g.contiguous(), ctx.mesh, ctx.axis, dim=ctx.dim, sizes=ctx.sizes, algorithm=ctx.algorithm)
        return gx, None, None, None, None


class _SplitAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, dim: int, algorithm: str) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.dim, ctx.algorithm = mesh, axis, dim, algorithm
        ctx.sizes = shard_sizes(x.shape[dim], mesh.size(axis))
        return local_slice(x, mesh, axis, dim)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:
        gx = all_gather(g.contiguous(), ctx.mesh, ctx.axis, dim=ctx.dim, sizes=ctx.sizes, algorithm=ctx.algorithm)
        return gx, None, None, None, None


class _AllGatherSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, dim: int, sizes: list[int] | None,
                algorithm: str) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.dim = mesh, axis, dim
        ctx.sizes = sizes if sizes is not None else [x.shape[dim]] * mesh.size(axis)
        return all_gather(x, mesh, axis, dim=dim, sizes=sizes, algorithm=algorithm)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None, None]:
        gx = torch.split(g, ctx.sizes, dim=ctx.dim)[ctx.mesh.coord(ctx.axis)].contiguous()
        return gx, None, None, None, None, None


def allreduce_identity(x: torch.Tensor, mesh: Mesh, axis: str, *, algorithm: str = "native") -> torch.Tensor:
    """Forward: sum over ``axis`` (P → B). Backward: identity. The output of a row-parallel linear."""
    return _AllReduceIdentity.apply(x, mesh, axis, algorithm)


def identity_allreduce(x: torch.Tensor, mesh: Mesh, axis: str, *, algorithm: str = "native") -> torch.Tensor:
    """Forward: identity. Backward: sum the gradient over ``axis``. The input of a column-parallel linear."""
    return _IdentityAllReduce.apply(x, mesh, axis, algorithm)


def allgather_reducescatter(x: torch.Tensor, mesh: Mesh, axis: str, *, dim: int,
                            sizes: Sequence[int] | None = None, algorithm: str = "native") -> torch.Tensor:
    """Forward: all-gather along ``dim`` (S → B). Backward: reduce-scatter of the (partial) gradient."""
    return _AllGatherReduceScatter.apply(x, mesh, axis, dim, list(sizes) if sizes is not None else None, algorithm)


def reducescatter_allgather(x: torch.Tensor, mesh: Mesh, axis: str, *, dim: int,
                            algorithm: str = "native") -> torch.Tensor:
    """Forward: reduce-scatter along ``dim`` (P → S). Backward: all-gather of the gradient."""
    return _ReduceScatterAllGather.apply(x, mesh, axis, dim, algorithm)


def split_allgather(x: torch.Tensor, mesh: Mesh, axis: str, *, dim: int, algorithm: str = "native") -> torch.Tensor:
    """Forward: keep this rank's slice along ``dim`` (B → S). Backward: all-gather of the gradient."""
    return _SplitAllGather.apply(x, mesh, axis, dim, algorithm)


def allgather_split(x: torch.Tensor, mesh: Mesh, axis: str, *, dim: int, sizes: Sequence[int] | None = None,
                    algorithm: str = "native") -> torch.Tensor:
    """Forward: all-gather along ``dim`` (S → B). Backward: keep this rank's slice of the (replicated) gradient."""
    return _AllGatherSplit.apply(x, mesh, axis, dim, list(sizes) if sizes is not None else None, algorithm)
