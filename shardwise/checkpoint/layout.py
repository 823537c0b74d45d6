"""How a live model's and optimizer's tensors are laid out, as ``Piece`` s, for sharded save and load.

A parameter is one of three kinds: plain (every rank holds it whole: ``B`` on every mesh axis — data
parallelism), annotated with its global spec (``sbp.params.annotate``: tensor-parallel ``S(d)`` shards), or
head-split (tensor-parallel QKV: ``_shardwise_heads``), stored through its (fused, nh·hd, ...) view split on
dim 1, or an expert-parallel piece (``parallel/common/expert_tag``: rows ``[i·E/ep, (i+1)·E/ep)`` of an (E, ...)
expert weight), described on its own expert mesh — ``S(0)`` over ``ep``, ``B`` over the others (``edp``, ``tp``,
``pp``) — so a checkpoint saved at one ep loads at any other through the index, as every other split does. Optimizer state tensors shaped like their parameter share its layout; other state (Adam's ``step``)
is replicated. Keys: ``model/<state_dict key>`` and ``optim/<parameter name>/<state name>``.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ..mesh import Mesh
from ..parallel.common.expert_tag import expert_shard_of
from ..sbp.placement import Replicate, Split
from ..sbp.params import spec_of
from .flat_state import param_state
from .full_state import unwrap
from .sharded import Checkpoint, Piece, replicated_piece

__all__ = ["model_pieces", "optimizer_pieces", "load_model", "load_optimizer", "describe", "local_of", "tied_aliases"]


def describe(key: str, t: torch.Tensor, mesh: Mesh, local: torch.Tensor | None = None) -> Piece:
    """The ``Piece`` of ``t`` on this rank (``local``: another tensor with ``t``'s layout, e.g. its Adam state)."""
    local = t if local is None else local
    coords = tuple(mesh.coord(a) for a in mesh.axes)
    heads = getattr(t, "_shardwise_heads", None)
    if heads is not None:
        _, axis, _fused, full_shape, view = heads[:5]  # view: see tensor.modules.shard_heads
        sbp = tuple(Split(1) if a == axis else Replicate() for a in mesh.axes)
        return Piece(key, local, view, tuple(full_shape), sbp, tuple(mesh.axes), tuple(mesh.shape), coords)
    shard = expert_shard_of(t)
    if shard is not None:
        return _expert_piece(key, t, local, shard)
    spec = spec_of(t)
    if spec is not None:
        if tuple(spec.axes) != tuple(mesh.axes) or tuple(spec.mesh_shape) != tuple(mesh.shape):
            raise ValueError(f"{key}: annotated on mesh {dict(zip(spec.axes, spec.mesh_shape))} but saved with mesh "
                             f"{dict(zip(mesh.axes, mesh.shape))}; pass the mesh the model was parallelized over")
        return Piece(key, local, tuple(spec.shape), tuple(spec.shape), tuple(spec.sbp), tuple(mesh.axes),
                     tuple(mesh.shape), coords)
    return replicated_piece(key, local, mesh)


def _expert_piece(key: str, t: torch.Tensor, local: torch.Tensor, shard: object) -> Piece:
    """An expert weight's piece (E / ep experts of ``t``'s (E, ...) tensor) on the expert mesh of ``shard``
    (a ``parallel.expert.ExpertShard``): ``S(0)`` over its axis, ``B`` over the rest. Pure."""
    em, axis = shard.mesh, shard.axis  # type: ignore[attr-defined]
    full = (shard.n_experts, *t.shape[1:])  # type: ignore[attr-defined]
    sbp = tuple(Split(0) if a == axis else Replicate() for a in em.axes)
    return Piece(key, local, full, full, sbp, tuple(em.axes), tuple(em.shape), tuple(em.coord(a) for a in em.axes))


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """State-dict entries of the plain model, each storage once (a tied weight under its first key)."""
    seen: set[int] = set()
    for key, value in unwrap(model).state_dict(keep_vars=True).items():
        if id(value) in seen:
            continue
        seen.add(id(value))
        yield key, value


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """``{second key: first key}`` for state-dict entries that share one tensor (tied weights)."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for key, value in unwrap(model).state_dict(keep_vars=True).items():
        if id(value) in first:
            out[key] = first[id(value)]
        else:
            first[id(value)] = key
    return out


def model_pieces(model: nn.Module, mesh: Mesh) -> list[Piece]:
    """This rank's pieces of the model (wrappers peeled off; keys are the plain model's). Local."""
    # describe() reads the layout attributes of the parameter itself; the piece holds a detached alias.
    return [describe(f"model/{k}", v, mesh, v.detach()) for k, v in _named_tensors(model)]


def _param_names(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in unwrap(model).named_parameters()}


def optimizer_pieces(model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> list[Piece]:
    """This rank's pieces of the optimizer's per-parameter state, keyed by parameter name. Local."""
    names = _param_names(model)
    out: list[Piece] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for name, value in optimizer.state.get(p, {}).items():
                key = f"optim/{names[id(p)]}/{name}"
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value)
                if value.shape == p.shape and value.dim() > 0:
                    out.append(describe(key, p, mesh, value.detach()))
                else:
                    out.append(replicated_piece(key, value.detach(), mesh))
    return out


@torch.no_grad()
def load_model(ckpt: Checkpoint, model: nn.Module, mesh: Mesh) -> None:
    """Copy the checkpoint's values into this rank's pieces of ``model``, resharding from whatever layout
    saved them. Reads files only (no communication); every rank loads the pieces it holds."""
    for key, value in _named_tensors(model):
        if key in ckpt.omitted:  # a frozen parameter left out (frozen.py): the model holds its pretrained value
            continue
        target = describe(f"model/{key}", value, mesh)
        value.copy_(ckpt.load_piece(target).to(value.dtype))


def local_of(full: torch.Tensor, t: torch.Tensor, mesh: Mesh, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
    """This rank's piece (of ``shape``) of ``full``, a tensor of the plain model's shape laid out like ``t`` (a
    tp-split parameter: its shard; a replicated one: ``full`` itself). Reads only ``t``'s layout attributes, so
    ``t`` may be a freed ZeRO stage-3 parameter. Local."""
    target = describe("", t, mesh, torch.empty(shape, device="meta"))
    index = tuple(slice(s, s + n) for s, n in target.extent())
    return full.reshape(target.view_shape)[index].reshape(shape)


@torch.no_grad()
def load_optimizer(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh) -> None:
    """Fill ``optimizer.state`` for this rank's parameters from the checkpoint — saved in any layout,
    ZeRO's flat shards included. Local (file reads)."""
    names = _param_names(model)
    saved, fetch = param_state(ckpt)
    for group in optimizer.param_groups:
        for p in group["params"]:
            state: dict[str, torch.Tensor] = {}
            for name in saved.get(names[id(p)], []):
                full = fetch(names[id(p)], name)
                target = describe(f"optim/{names[id(p)]}/{name}", p, mesh, torch.empty_like(p))
                if full.dim() > 0 and tuple(full.shape) == target.full_shape:  # shaped like its parameter
                    state[name] = local_of(full, p, mesh, p.shape).to(p.device).clone()
                else:  # scalars (Adam's step) stay on the CPU, as torch keeps them
                    state[name] = full.clone()
            if state:
                optimizer.state[p] = state
