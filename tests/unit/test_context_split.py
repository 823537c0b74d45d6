"""How ``shardwise train`` cuts a step's batches for context parallelism (``runtime/context_split.py``), pure:
without a pipeline each rank keeps chunks c and 2·cp−1−c of every row; with one, every replica's rows are laid
out so that the pipeline's dp × cp slicing (block ``d·cp + c``) hands each rank exactly those chunks of its
replica's rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from shardwise.runtime.config_schema import ParallelConfig
from shardwise.runtime.context_split import ContextSplit, cp_mesh_axes


@dataclass
class _Mesh:  # what ContextSplit and shard_sequence read of a mesh
    cp: int
    c: int

    @property
    def axes(self) -> tuple[str, ...]:
        return ("cp",)

    def size(self, axis: str) -> int:
        return self.cp

    def coord(self, axis: str) -> int:
        return self.c


def _expected(row: torch.Tensor, cp: int, c: int) -> torch.Tensor:
    n = row.numel() // (2 * cp)
    return torch.cat([row[c * n:(c + 1) * n], row[(2 * cp - 1 - c) * n:(2 * cp - c) * n]])


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_each_rank_keeps_its_two_chunks(cp):
    x = torch.arange(3 * 8 * cp).reshape(3, 8 * cp)  # 3 rows of S = 8·cp positions
    for c in range(cp):
        (lx, ly), = ContextSplit(_Mesh(cp, c), pipeline=False, dp=1)([(x, x + 1000)])
        assert lx.shape == (3, 8)  # S / cp
        for r in range(3):
            assert torch.equal(lx[r], _expected(x[r], cp, c)) and torch.equal(ly[r], _expected(x[r] + 1000, cp, c))


@pytest.mark.parametrize("dp, cp", [(1, 2), (2, 2), (3, 2), (2, 4)])
def test_pipeline_rows_slice_into_each_ranks_chunks(dp, cp):
    b, s = 2, 4 * cp
    x = torch.arange(dp * b * s).reshape(dp * b, s)  # replica d's rows: block d of dp
    (ax, _), = ContextSplit(_Mesh(cp, 0), pipeline=True, dp=dp)([(x, x)])
    assert ax.shape == (dp * cp * b, s // cp)
    for d in range(dp):
        for c in range(cp):
            mine = ax.chunk(dp * cp)[d * cp + c]  # what the pipeline gives the rank at (d, c)
            for r in range(b):
                assert torch.equal(mine[r], _expected(x[d * b + r], cp, c))


def test_the_attention_mesh_puts_cp_inside_dp():
    assert list(cp_mesh_axes(ParallelConfig(dp=2, cp=2, tp=2))) == ["dp", "cp", "tp"]
    assert list(cp_mesh_axes(ParallelConfig(dp=1, cp=2, tp=1, pp=2))) == ["pp", "dp", "cp", "tp"]
