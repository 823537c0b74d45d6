"""Cutting a model's experts over an expert-parallel axis: each MoE block keeps experts ``[i·E/ep, (i+1)·E/ep)``
on the axis coordinate ``i`` (a contiguous block along dim 0 of ``gate_up_proj`` (E, 2f, h) and ``down_proj``
(E, h, f)), and its token route goes through the all-to-all (``dispatch.py``).

Works on a built model (the rows are copied out) and on a meta-device one (each piece stays deferred and is
drawn by whichever wrapper materialises the model, from the same per-element values one device draws). An MoE
block is recognised by shape, not class: a module with a ``shard`` attribute, ``settings.n_experts`` and an
``experts`` child holding 3-D ``gate_up_proj`` / ``down_proj``."""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn

from ...mesh import Mesh
from ..common.expert_tag import EXPERT_ATTR, is_expert_param
from ..common.materialize import deferred_piece, ensure_sources
from .dispatch import ExpertShard

__all__ = ["shard_experts", "moe_blocks_of", "expert_params", "dense_params"]

EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")


def moe_blocks_of(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, block)`` of every MoE block (see the module docstring)."""
    for name, m in model.named_modules():
        experts = getattr(m, "experts", None)
        if (hasattr(m, "shard") and hasattr(getattr(m, "settings", None), "n_experts") and experts is not None
                and all(getattr(experts, w, None) is not None and getattr(experts, w).dim() == 3
                        for w in EXPERT_WEIGHTS)):
            yield name, m


def shard_experts(model: nn.Module, mesh: Mesh, axis: str = "ep", *, algorithm: str = "native") -> int:
    """Keep this rank's experts of every MoE block of ``model`` and route their tokens over ``axis`` of ``mesh``
    (whose ranks hold different tokens: data-parallel ones). Call on the root model before any wrapper
    (names are the root's). Returns the number of blocks cut. Local (no communication)."""
    size = mesh.size(axis)
    blocks = list(moe_blocks_of(model))
    if size == 1:
        return len(blocks)  # every expert here: the plain route, and the experts are ordinary parameters
    if any(w.is_meta for _, b in blocks for w in _weights(b)):
        ensure_sources(model)
    for name, block in blocks:
        n = block.settings.n_experts
        if n % size:
            raise ValueError(f"{name}: {n} experts cannot be split over {size} ranks of axis {axis!r}; the axis "
                             f"size must divide the expert count")
        shard = ExpertShard(mesh, axis, n, algorithm)
        for w in EXPERT_WEIGHTS:
            full = getattr(block.experts, w)
            if full.size(0) != n:
                raise ValueError(f"{name}.experts.{w} holds {full.size(0)} experts, not {n}: already sharded")
            piece = _piece(full, shard)
            setattr(piece, EXPERT_ATTR, shard)
            setattr(block.experts, w, piece)
        block.shard = shard
    return len(blocks)


def _weights(block: nn.Module) -> list[torch.Tensor]:
    return [getattr(block.experts, w) for w in EXPERT_WEIGHTS]


def _piece(full: torch.Tensor, shard: ExpertShard) -> nn.Parameter:
    rows = [(shard.first, shard.local)]
    if full.is_meta:
        return deferred_piece(full, rows, None)
    with torch.no_grad():
        local = full.detach()[shard.first: shard.first + shard.local].clone()
    return nn.Parameter(local, requires_grad=full.requires_grad)


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The expert-parallel parameters of ``model`` (tagged by ``shard_experts``), in registration order."""
    return [p for p in model.parameters() if is_expert_param(p)]


def dense_params(model: nn.Module) -> list[nn.Parameter]:
    """Every other parameter."""
    return [p for p in model.parameters() if not is_expert_param(p)]
