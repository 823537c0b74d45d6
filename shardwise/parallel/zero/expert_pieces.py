"""Expert-parallel pieces seen from the data-parallel side (``sw.zero`` and full state dicts): a tensor tagged by
``parallel/expert/shard.py`` holds rows ``[i·E/ep, (i+1)·E/ep)`` of an (E, ...) expert weight on ep coordinate
``i`` of its expert mesh. ZeRO leaves these out of its flat groups (``data/replicas.trainable``); loading cuts a
rank's rows out of a full tensor, and a full state dict gathers them."""

from __future__ import annotations

import torch

from ...comm.collectives import all_gather
from ..common.expert_tag import expert_shard_of

__all__ = ["expert_rows", "gather_expert"]


def expert_rows(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor | None:
    """This rank's rows of ``full`` (E, ...) for the expert piece ``t`` (E / ep, ...); None when ``t`` is not an
    expert piece or ``full`` is not the whole tensor (then the caller's shape check names it). Pure."""
    shard = expert_shard_of(t)
    if shard is None or full.dim() == 0 or full.size(0) != shard.n_experts:
        return None
    return full[shard.first: shard.first + shard.local]


def gather_expert(t: torch.Tensor) -> torch.Tensor | None:
    """The whole (E, ...) tensor of the expert piece ``t`` (every ep rank's rows, in order); None when ``t`` is
    not one. Collective over the expert mesh's ep axis."""
    shard = expert_shard_of(t)
    if shard is None:
        return None
    if shard.size == 1:
        return t.detach().clone()
    return all_gather(t.detach().contiguous(), shard.mesh, shard.axis, dim=0)  # type: ignore[return-value]
