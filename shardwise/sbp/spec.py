"""Where each rank's piece of a global tensor lies: pure shape arithmetic, no processes.

``TensorSpec`` = global shape + dtype + one placement per mesh axis (+ the mesh's axis names and sizes). Splits
of one dim by several axes nest in axis order (the outer axis cuts first). Pieces follow ``shard_sizes``:
the first ``L % n`` ranks of an axis get one extra row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..comm.ops import shard_sizes
from .placement import Placement, Split, format_sbp

__all__ = ["TensorSpec", "local_extent", "local_shape", "axis_piece_sizes"]


def local_extent(global_shape: Sequence[int], sbp: Sequence[Placement], mesh_shape: Sequence[int],
                 coords: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, length)`` per tensor dim of the piece held at mesh ``coords``."""
    extent = [(0, int(s)) for s in global_shape]
    for p, n, c in zip(sbp, mesh_shape, coords):
        if isinstance(p, Split):
            start, length = extent[p.dim]
            sizes = shard_sizes(length, n)
            extent[p.dim] = (start + sum(sizes[:c]), sizes[c])
    return extent


def local_shape(global_shape: Sequence[int], sbp: Sequence[Placement], mesh_shape: Sequence[int],
                coords: Sequence[int]) -> tuple[int, ...]:
    return tuple(length for _, length in local_extent(global_shape, sbp, mesh_shape, coords))


def axis_piece_sizes(global_shape: Sequence[int], sbp: Sequence[Placement], mesh_shape: Sequence[int],
                     coords: Sequence[int], axis_index: int) -> list[int]:
    """Sizes along the split dim of the pieces held by the ranks of axis ``axis_index`` (the others' coords
    fixed): what an all-gather over that axis concatenates. The axis must hold a ``Split``."""
    p = sbp[axis_index]
    assert isinstance(p, Split)
    outer = list(sbp[:axis_index]) + [None] * (len(sbp) - axis_index)  # splits by outer axes only
    parent = local_extent(global_shape, outer, mesh_shape, coords)[p.dim][1]  # type: ignore[arg-type]
    return shard_sizes(parent, mesh_shape[axis_index])


@dataclass(frozen=True, eq=True)
class TensorSpec:
    """The global description of a tensor spread over a mesh."""

    shape: tuple[int, ...]
    """Global (logical) shape."""
    dtype: torch.dtype
    sbp: tuple[Placement, ...]
    """One placement per mesh axis."""
    axes: tuple[str, ...]
    """Mesh axis names, outermost first."""
    mesh_shape: tuple[int, ...]

    def __hash__(self) -> int:
        # Specs key the op-dispatch cache: hash once, not on every op.
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash((self.shape, self.dtype, self.sbp, self.axes, self.mesh_shape))
            object.__setattr__(self, "_hash", h)
        return h

    def local_shape(self, coords: Sequence[int]) -> tuple[int, ...]:
        return local_shape(self.shape, self.sbp, self.mesh_shape, coords)

    def local_extent(self, coords: Sequence[int]) -> list[tuple[int, int]]:
        return local_extent(self.shape, self.sbp, self.mesh_shape, coords)

    def with_sbp(self, sbp: Sequence[Placement]) -> "TensorSpec":
        return TensorSpec(self.shape, self.dtype, tuple(sbp), self.axes, self.mesh_shape)

    def __str__(self) -> str:
        axes = ",".join(f"{a}={n}" for a, n in zip(self.axes, self.mesh_shape))
        return f"{list(self.shape)} {str(self.dtype).replace('torch.', '')} [{format_sbp(self.sbp)}] on ({axes})"
