"""``full_state_dict``: the whole model's tensors under the unwrapped model's keys, whatever the layout.

Wrappers (``DataParallel``, and later ZeRO and pipeline wrappers) are peeled off through ``.module``; a wrapper
that owns sharded storage itself exposes ``full_state_dict()`` and is asked directly. Annotated tensors (see
``sbp/params.py``: tensor-parallel shards) are gathered to their full value by boxing to B on every axis;
expert-parallel pieces (``parallel.expert.shard_experts``) by an all-gather of their rows over the ep axis.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..parallel.common.expert_tag import expert_shard_of
from ..parallel.zero.expert_pieces import gather_expert
from ..sbp.params import as_global

__all__ = ["full_state_dict", "unwrap"]


def _with_experts(out: dict[str, torch.Tensor], plain: nn.Module) -> dict[str, torch.Tensor]:
    """``out`` with every expert-parallel piece a wrapper's own ``full_state_dict`` left local (one that does not
    know experts: ``sw.parallelize``'s) replaced by its all-gather over ep. Collective over ep where needed (the
    same keys on every rank)."""
    if not isinstance(plain, nn.Module):  # a wrapper without ``.module`` (``sw.pipeline``): its own dict is whole
        return out
    for key, value in plain.state_dict(keep_vars=True).items():
        shard = expert_shard_of(value) if isinstance(value, torch.Tensor) else None
        if shard is not None and key in out and out[key].size(0) != shard.n_experts:
            out[key] = gather_expert(value)  # type: ignore[assignment]
    return out


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside any number of shardwise wrappers (each keeps it as ``.module``)."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def full_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """Full, unsharded, detached tensors with the same keys as the unwrapped model's ``state_dict()``.

    Collective: every rank of every mesh the model is sharded over must call it (each rank gets the full
    dict). Tied parameters appear under every key that the plain model's state_dict has for them.
    """
    probe = model
    while True:
        custom = getattr(probe, "full_state_dict", None)
        if callable(custom):
            return _with_experts(custom(), unwrap(model))
        if hasattr(probe, "module") and isinstance(probe.module, nn.Module):
            probe = probe.module
            continue
        break
    plain = unwrap(model)
    out: dict[str, torch.Tensor] = {}
    for key, value in plain.state_dict(keep_vars=True).items():
        expert = gather_expert(value) if isinstance(value, torch.Tensor) else None
        if expert is not None:  # an expert-parallel piece: the ep ranks' rows (collective over ep)
            out[key] = expert
            continue
        g = as_global(value) if isinstance(value, torch.Tensor) else None
        out[key] = g.full().detach() if g is not None else value.detach()
    return out
