"""Expert-parallel pieces seen from the data-parallel side (``sw.zero`` and full state dicts): a tensor tagged by
``parallel/expert/shard.py`` holds rows ``[i·E/ep, (i+1)·E/ep)`` of an (E, ...) expert weight on ep coordinate
``i`` of its expert mesh. ZeRO leaves these out of its flat groups (``data/replicas.trainable``); loading cuts a
rank's rows out of a full tensor, and a full state dict gathers them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...comm.collectives import all_gather
from ..common.expert_tag import expert_shard_of
from ..tensor.apply_plan import local_piece

if TYPE_CHECKING:
    from .flat import FlatGroup

__all__ = ["expert_rows", "gather_expert", "local_value", "gather_master"]


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


def local_value(t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` for the tensor ``t`` (a tp-split one's shard); ``full`` as given when its
    shape is not the full shape of ``t``'s layout (then the caller's shape check names the mismatch)."""
    rows = expert_rows(t, full)  # an expert piece (ep rows of an (E, ...) weight), not tensor-parallel
    if rows is not None:
        return rows
    try:
        return local_piece(t, full)
    except (RuntimeError, ValueError):  # reshape/boxing of a wrongly shaped tensor
        return full


def gather_master(g: "FlatGroup") -> torch.Tensor:
    """Every rank's master shard of group ``g`` concatenated: ``(L,)`` in master precision. Collective over its axis."""
    return all_gather(g.master.detach(), g.mesh, g.axis, sizes=list(g.layout.shard_sizes))  # type: ignore[return-value]
