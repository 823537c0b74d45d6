"""The balanced sequence layout of context parallelism.

The global sequence of length ``S`` is cut into ``2·cp`` equal chunks; cp rank ``i`` holds chunks ``i`` and
``2·cp−1−i``, concatenated in that order. Under a causal mask early chunks attend to little and late chunks
to much, so pairing chunk ``i`` with its mirror gives every rank the same work.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ...comm.collectives import all_gather

__all__ = ["SeqLayout", "shard_sequence", "unshard_sequence", "chunk_order", "check_divisible"]


def chunk_order(cp: int) -> list[int]:
    """The global chunk indices in the order the ranks hold them, rank 0 first: ``[0, 2cp-1, 1, 2cp-2, ...]``."""
    return [c for i in range(cp) for c in (i, 2 * cp - 1 - i)]


def check_divisible(length: int, cp: int) -> None:
    if length % (2 * cp):
        raise ValueError(f"sequence length S={length} must be divisible by 2·cp={2 * cp}; choose a block size "
                         f"that is a multiple of {2 * cp}")


@dataclass(frozen=True)
class SeqLayout:
    """Which global positions cp rank ``rank`` of ``cp`` holds. ``mesh`` and ``axis`` (set by
    ``sw.context_parallel``; not compared): where ``unshard`` gathers the other ranks' chunks."""

    cp: int
    rank: int
    mesh: Any = field(default=None, compare=False, repr=False)
    axis: str = field(default="cp", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (isinstance(self.cp, int) and self.cp >= 1 and isinstance(self.rank, int) and 0 <= self.rank < self.cp):
            raise ValueError(f"SeqLayout(cp={self.cp!r}, rank={self.rank!r}): need cp >= 1 and 0 <= rank < cp")

    def positions(self, local_len: int, device: Any = None) -> Tensor:
        """The global positions (local_len,) of this rank's tokens: chunk ``rank``, then chunk ``2·cp−1−rank``."""
        if local_len % 2:
            raise ValueError(f"a context-parallel rank holds two equal chunks, but the local sequence has "
                             f"{local_len} tokens; shard a sequence divisible by 2·cp={2 * self.cp} with "
                             f"shard_sequence")
        c = local_len // 2
        first, second = self.rank * c, (2 * self.cp - 1 - self.rank) * c
        return torch.cat([torch.arange(first, first + c, device=device),
                          torch.arange(second, second + c, device=device)])

    def unshard(self, local: Tensor, dim: int = 1) -> Tensor:
        """The whole sequence of ``local`` (this rank's two chunks along ``dim``): ``unshard_sequence`` over the
        layout's mesh axis (collective over it; no gradient). ``ValueError`` without a mesh."""
        if self.cp == 1:
            return local.detach()
        if self.mesh is None:
            raise ValueError("SeqLayout.unshard needs the layout's mesh; use the layout sw.context_parallel sets, or "
                             "SeqLayout(cp, rank, mesh=MESH, axis=AXIS)")
        return unshard_sequence(local, self.mesh, self.axis, dim)


def shard_sequence(t: Tensor, mesh: Any, axis: str = "cp", dim: int = 1) -> Tensor:
    """This rank's two chunks of the full tensor ``t`` (sequence along ``dim``), contiguous. No communication."""
    cp, rank = mesh.size(axis), mesh.coord(axis)
    check_divisible(t.shape[dim], cp)
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim).contiguous()


def reorder_gathered(gathered: Tensor, cp: int, dim: int) -> Tensor:
    """The full sequence from the ranks' local pieces concatenated in rank order along ``dim``."""
    pieces = gathered.chunk(2 * cp, dim=dim)
    by_chunk = [None] * (2 * cp)
    for piece, chunk in zip(pieces, chunk_order(cp)):
        by_chunk[chunk] = piece
    return torch.cat(by_chunk, dim=dim)


def unshard_sequence(local: Tensor, mesh: Any, axis: str = "cp", dim: int = 1) -> Tensor:
    """The full tensor from every rank's ``local`` piece (all-gather over ``axis``, then back into sequence
    order). Collective over ``axis``; for tests and evaluation (no gradient flows through it)."""
    cp = mesh.size(axis)
    dim = dim % local.dim()
    if local.shape[dim] % 2:
        raise ValueError(f"unshard_sequence: the local piece has {local.shape[dim]} positions along dim {dim}, "
                         f"not two equal chunks; pass the tensor shard_sequence returned")
    gathered = all_gather(local.detach().contiguous(), mesh, axis, dim=dim) if cp > 1 else local.detach()
    return reorder_gathered(gathered, cp, dim)
