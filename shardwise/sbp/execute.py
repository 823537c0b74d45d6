"""Boxing executor: run a ``BoxingRoute`` on a local tensor, differentiably.

Gradient convention (Megatron's): the local gradient of a tensor placed ``S`` is the matching slice of the
logical gradient, of a tensor placed ``B`` the whole logical gradient on every rank, and of a tensor placed
``P`` also the whole logical gradient (d(Σ_r x_r)/dx_r = 1). So a loss that is ``B`` is back-propagated with
gradient 1 on every rank, and each step's backward is the conjugate listed in ``boxing.py``.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..comm import autograd as cag
from ..comm.collectives import all_reduce, all_to_all
from ..comm.ops import shard_sizes
from ..mesh import Mesh
from .boxing import BoxingRoute, BoxingStep
from .placement import Placement, Split
from .spec import axis_piece_sizes

__all__ = ["run_plan"]


class _AllToAll(torch.autograd.Function):
    """S(i) → S(j) on one axis; backward is S(j) → S(i)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, i: int, j: int, sizes_i: list[int]) -> torch.Tensor:
        ctx.mesh, ctx.axis, ctx.i, ctx.j = mesh, axis, i, j
        ctx.sizes_j = shard_sizes(x.shape[j], mesh.size(axis))
        return all_to_all(x.contiguous(), mesh, axis, split_dim=j, concat_dim=i, concat_sizes=sizes_i)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gx = all_to_all(g.contiguous(), ctx.mesh, ctx.axis, split_dim=ctx.i, concat_dim=ctx.j,
                        concat_sizes=ctx.sizes_j)
        return gx, None, None, None, None, None


class _KeepOne(torch.autograd.Function):
    """B → P(sum): the first rank of the axis keeps the value, the others hold zeros; backward identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, keep: bool) -> torch.Tensor:
        return x.clone() if keep else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return g, None


class _AllReduceMax(torch.autograd.Function):
    """P(max) → B; backward sends the gradient to the elements that were the maximum (ties all receive it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str) -> torch.Tensor:
        out = x.clone()
        all_reduce(out, mesh, axis, op="max")
        ctx.save_for_backward(x == out)
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (mask,) = ctx.saved_tensors
        return g * mask.to(g.dtype), None, None


def _zero_pad(x: torch.Tensor, dim: int, sizes: list[int], coord: int) -> torch.Tensor:
    """S(d) → P(sum): place the local piece at its offset inside zeros of the parent extent."""
    shape = list(x.shape)
    shape[dim] = sum(sizes)
    out = x.new_zeros(shape)
    out.narrow(dim, sum(sizes[:coord]), sizes[coord]).copy_(x)
    return out


def _run_step(x: torch.Tensor, step: BoxingStep, state: Sequence[Placement], shape: Sequence[int],
              mesh: Mesh) -> torch.Tensor:
    axis, coords = step.axis, tuple(mesh.coord(a) for a in mesh.axes)
    src, dst, coll = step.src, step.dst, step.collective
    if coll == "all_gather":
        assert isinstance(src, Split)
        sizes = axis_piece_sizes(shape, state, mesh.shape, coords, step.axis_index)
        return cag.allgather_split(x, mesh, axis, dim=src.dim, sizes=sizes)
    if coll == "slice":
        assert isinstance(dst, Split)
        return cag.split_allgather(x, mesh, axis, dim=dst.dim)
    if coll == "all_to_all":
        assert isinstance(src, Split) and isinstance(dst, Split)
        sizes = axis_piece_sizes(shape, state, mesh.shape, coords, step.axis_index)
        return _AllToAll.apply(x, mesh, axis, src.dim, dst.dim, sizes)
    if coll == "zero_pad":
        assert isinstance(src, Split)
        sizes = axis_piece_sizes(shape, state, mesh.shape, coords, step.axis_index)
        return _zero_pad(x, src.dim, sizes, mesh.coord(axis))
    if coll == "keep_one":
        return _KeepOne.apply(x, mesh.coord(axis) == 0)
    if coll == "identity":
        return x
    if coll == "all_reduce":
        if getattr(src, "op", "sum") == "max":
            return _AllReduceMax.apply(x, mesh, axis)
        return cag.allreduce_identity(x, mesh, axis)
    if coll == "reduce_scatter":
        assert isinstance(dst, Split)
        return cag.reducescatter_allgather(x, mesh, axis, dim=dst.dim)
    raise AssertionError(f"unknown boxing collective {coll}")


def run_plan(x: torch.Tensor, plan: BoxingRoute, shape: Sequence[int], mesh: Mesh) -> torch.Tensor:
    """Apply every step of ``plan`` to the local tensor ``x`` (collective over the axes the steps name)."""
    state = list(plan.src)
    for step in plan.steps:
        x = _run_step(x, step, state, shape, mesh)
        state[step.axis_index] = step.dst
    return x
