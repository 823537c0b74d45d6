"""``GlobalTensor``: one logical tensor spread over a mesh, its local piece plus its ``TensorSpec``.

A plain Python wrapper (not a ``torch.Tensor`` subclass): autograd runs on the local tensors, so a global
tensor costs one attribute lookup over its local tensor and nothing per op that the user does locally.
``to_local()`` is differentiable and returns the very tensor the wrapper holds.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..mesh import Mesh
from .boxing import BoxingRoute, CostFn, route_boxing
from .dispatch import dispatch
from .execute import run_plan
from .placement import Replicate, Partial, Placement, Split, format_sbp, normalize_sbp
from .spec import TensorSpec

__all__ = ["GlobalTensor", "distribute", "to_global"]


class GlobalTensor:
    """A logical tensor of ``spec.shape`` on ``mesh`` with placements ``spec.sbp`` (one per mesh axis)."""

    __slots__ = ("_local", "spec", "mesh")

    def __init__(self, local: torch.Tensor, spec: TensorSpec, mesh: Mesh) -> None:
        self._local, self.spec, self.mesh = local, spec, mesh

    # -- description -----------------------------------------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.spec.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def sbp(self) -> tuple[Placement, ...]:
        return self.spec.sbp

    @property
    def requires_grad(self) -> bool:
        return self._local.requires_grad

    @property
    def device(self) -> torch.device:
        return self._local.device

    def dim(self) -> int:
        return len(self.spec.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.spec.shape)

    def __repr__(self) -> str:
        return f"GlobalTensor({self.spec}, local={tuple(self._local.shape)})"

    # -- conversions -----------------------------------------------------------------------------------
    def to_local(self) -> torch.Tensor:
        """This rank's piece (differentiable; no communication)."""
        return self._local

    def plan_to(self, sbp: Sequence[Placement] | str, cost_fn: CostFn | None = None) -> BoxingRoute:
        """The boxing route ``to_sbp`` would run (pure: no communication)."""
        dst = normalize_sbp(sbp, self.dim(), len(self.mesh.axes))
        return route_boxing(self.spec.shape, self._local.element_size(), self.spec.sbp, dst, self.mesh.shape,
                           self.mesh.axes, cost_fn)

    def to_sbp(self, sbp: Sequence[Placement] | str, *, cost_fn: CostFn | None = None) -> "GlobalTensor":
        """Re-distribute to ``sbp`` with the cheapest sequence of collectives (differentiable). Collective
        over every axis whose placement changes."""
        if sbp == self.spec.sbp and cost_fn is None:  # hot path of op dispatch: already in place
            return self
        plan = self.plan_to(sbp, cost_fn)
        if not plan.steps:
            return self
        local = run_plan(self._local, plan, self.spec.shape, self.mesh)
        return GlobalTensor(local, self.spec.with_sbp(plan.dst), self.mesh)

    def full(self) -> torch.Tensor:
        """The whole logical tensor on every rank (differentiable). Collective."""
        return self.to_sbp([Replicate()] * len(self.mesh.axes)).to_local()

    # -- ops (rules in rules.py, dispatch in dispatch.py) ------------------------------------------------
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        return dispatch(func, tuple(args), kwargs, GlobalTensor)  # injected: dispatch.py does not import us

    def __add__(self, other): return torch.add(self, other)  # noqa: E704
    def __radd__(self, other): return torch.add(self, other)  # noqa: E704
    def __sub__(self, other): return torch.sub(self, other)  # noqa: E704
    def __mul__(self, other): return torch.mul(self, other)  # noqa: E704
    def __rmul__(self, other): return torch.mul(self, other)  # noqa: E704
    def __truediv__(self, other): return torch.div(self, other)  # noqa: E704
    def __neg__(self): return torch.neg(self)  # noqa: E704
    def __matmul__(self, other): return torch.matmul(self, other)  # noqa: E704

    def reshape(self, *shape: int) -> "GlobalTensor":
        return torch.reshape(self, tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape)

    view = reshape

    def transpose(self, dim0: int, dim1: int) -> "GlobalTensor":
        return torch.transpose(self, dim0, dim1)

    def permute(self, *dims: int) -> "GlobalTensor":
        return torch.permute(self, tuple(dims[0]) if len(dims) == 1 and not isinstance(dims[0], int) else dims)

    def sum(self, dim=None, keepdim: bool = False) -> "GlobalTensor":  # type: ignore[no-untyped-def]
        return torch.sum(self) if dim is None else torch.sum(self, dim=dim, keepdim=keepdim)

    def mean(self, dim=None, keepdim: bool = False) -> "GlobalTensor":  # type: ignore[no-untyped-def]
        return torch.mean(self) if dim is None else torch.mean(self, dim=dim, keepdim=keepdim)

    def softmax(self, dim: int) -> "GlobalTensor":
        return torch.softmax(self, dim)

    def backward(self, gradient: torch.Tensor | None = None) -> None:
        """Back-propagate from a B (replicated) scalar loss: every rank seeds gradient 1 (see execute.py)."""
        if any(not isinstance(p, Replicate) for p in self.sbp):
            raise ValueError(f"backward needs a replicated (all-B) tensor, this one is [{format_sbp(self.sbp)}]; "
                             f"call .to_sbp('B'...) first (a P loss reduced with to_sbp is the usual case)")
        self._local.backward(gradient)

    def detach(self) -> "GlobalTensor":
        return GlobalTensor(self._local.detach(), self.spec, self.mesh)

    def requires_grad_(self, flag: bool = True) -> "GlobalTensor":
        self._local.requires_grad_(flag)
        return self

    @property
    def grad(self) -> "GlobalTensor | None":
        """The gradient as a global tensor: ``S`` stays ``S``; ``B`` and ``P`` give ``B`` (see execute.py)."""
        g = self._local.grad
        if g is None:
            return None
        sbp = tuple(Replicate() if isinstance(p, Partial) else p for p in self.spec.sbp)
        return GlobalTensor(g, self.spec.with_sbp(sbp), self.mesh)


def _coords(mesh: Mesh) -> tuple[int, ...]:
    return tuple(mesh.coord(a) for a in mesh.axes)


def to_global(local: torch.Tensor, mesh: Mesh, sbp: Sequence[Placement] | str,
              shape: Sequence[int] | None = None) -> GlobalTensor:
    """Wrap this rank's ``local`` piece. Without ``shape`` the global shape assumes even splits (local size
    × ranks along every split dim); give ``shape`` for uneven splits. No communication."""
    sbp_t = normalize_sbp(sbp, local.dim(), len(mesh.axes))
    if shape is None:
        dims = list(local.shape)
        for p, n in zip(sbp_t, mesh.shape):
            if isinstance(p, Split):
                dims[p.dim] *= n
        shape = dims
    spec = TensorSpec(tuple(int(s) for s in shape), local.dtype, sbp_t, mesh.axes, mesh.shape)
    expected = spec.local_shape(_coords(mesh))
    if tuple(local.shape) != expected:
        raise ValueError(f"local tensor of shape {tuple(local.shape)} does not fit global shape {list(spec.shape)} "
                         f"with SBP [{format_sbp(sbp_t)}] at mesh coords {_coords(mesh)}: expected {expected}; "
                         f"uneven splits give the first (size % n) ranks one extra row — pass the right shape=")
    return GlobalTensor(local, spec, mesh)


def distribute(full: torch.Tensor, mesh: Mesh, sbp: Sequence[Placement] | str) -> GlobalTensor:
    """Spread a tensor that every rank holds in full to ``sbp`` (S: local slice; B: keep; P(sum): the first rank
    of each P axis keeps it, the others hold zeros; P(max): every rank keeps it). Differentiable; no
    communication in forward."""
    dst = normalize_sbp(sbp, full.dim(), len(mesh.axes))
    replicated = to_global(full, mesh, [Replicate()] * len(mesh.axes))
    return replicated.to_sbp(dst)
