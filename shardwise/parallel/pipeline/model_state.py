"""The whole model's tensors around a pipeline: what each rank keeps, and how the full state is put together.

Every rank builds the whole model (same seed, so the weights agree with one device), but a pipeline rank
needs only its own stages. ``release_other_stages`` points every parameter and buffer that no local stage
uses at an empty tensor, so after ``sw.pipeline`` a rank holds about 1/pp of the model (the module objects and
their ``state_dict`` keys stay). Before that, ``full_meta`` records each key's *full* shape and dtype — through
the tensor-parallel global view for a sharded parameter — which is all a receiver needs to take its part of
``full_state``: each key's owner (the pp coordinate running the module) gathers it over tensor-parallel
axes if sharded (an expert-parallel piece over its ep axis), then broadcasts it along the pipeline axis, one
flat message per (owner, dtype).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import Tensor, nn

from ... import comm
from ...mesh import Mesh
from ..common.expert_tag import expert_shard_of
from ..tensor.apply_plan import global_view
from ..zero.expert_pieces import gather_expert

__all__ = ["full_meta", "release_other_stages", "key_owner", "full_state"]

Meta = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _full_shape(value: Tensor) -> tuple[int, ...]:
    heads = getattr(value, "_shardwise_heads", None)
    if heads is not None:  # head-split QKV: the plain (out, in) shape of the unsharded weight
        return tuple(heads[3])
    shard = expert_shard_of(value)
    if shard is not None:  # rows of an (E, ...) expert weight
        return (shard.n_experts, *value.shape[1:])
    g = global_view(value)
    return tuple(g.shape) if g is not None else tuple(value.shape)


def full_meta(model: nn.Module) -> Meta:
    """``{state_dict key: (full shape, dtype)}`` of every tensor of ``model`` (local, no communication)."""
    return {k: (_full_shape(v), v.dtype) for k, v in model.state_dict(keep_vars=True).items()}


def release_other_stages(model: nn.Module, local_modules: Iterable[nn.Module]) -> int:
    """Replace the storage of every parameter and buffer of ``model`` that none of ``local_modules`` uses by an
    empty tensor; return the bytes released. The Parameter objects (and their hooks, names) stay."""
    keep = {id(t) for m in local_modules for t in (*m.parameters(), *m.buffers())}
    freed = 0
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if id(t) not in keep and t.numel() > 0 and not t.is_meta:  # meta: never allocated
                freed += t.numel() * t.element_size()
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    return freed


def key_owner(keys: Iterable[str], module_owner: dict[str, int]) -> dict[str, int]:
    """``{state_dict key: pp coordinate}``: the owner of the longest module name that prefixes the key."""
    return {k: module_owner[max((n for n in module_owner if k.startswith(n + ".")), key=len)] for k in keys}


def _unsharded(value: Tensor) -> Tensor:
    """``value`` gathered over the tensor-parallel axes it is split on, or an expert piece over its ep axis
    (collective over those axes)."""
    expert = gather_expert(value)
    if expert is not None:
        return expert
    heads = getattr(value, "_shardwise_heads", None)
    g = global_view(value)
    full = g.full().detach() if g is not None else value.detach()
    return full.reshape(heads[3]) if heads is not None else full


def full_state(model: nn.Module, meta: Meta, owner: dict[str, int], mesh: Mesh, axis: str) -> dict[str, Tensor]:
    """Every key's full tensor on every rank (see module doc). Collective over ``axis`` and, for sharded
    tensors, over the tensor-parallel axes (every rank of one pp coordinate walks the same keys)."""
    me, p = mesh.coord(axis), mesh.size(axis)
    local = model.state_dict(keep_vars=True)
    groups: dict[tuple[int, torch.dtype], list[str]] = {}
    for key in meta:
        groups.setdefault((owner[key], meta[key][1]), []).append(key)
    out: dict[str, Tensor] = {}
    for (rank, dtype), keys in groups.items():
        sizes = [int(torch.Size(meta[k][0]).numel()) for k in keys]
        if rank == me:
            flat = torch.cat([_unsharded(local[k]).reshape(-1).to(mesh.device) for k in keys])
        else:
            flat = torch.empty(sum(sizes), dtype=dtype, device=mesh.device)
        if p > 1:
            comm.broadcast(flat, mesh, axis, src=rank)
        for k, piece in zip(keys, flat.split(sizes)):
            out[k] = piece.view(meta[k][0]).clone()
    return out
