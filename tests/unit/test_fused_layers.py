"""Transposed and fused linear layers, the pure parts: which modules count as linear (and in which weight layout),
the styles' checks, and what ``sw.auto`` offers a fused projection. Runs on one process (no mesh)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise.mesh import MeshLayout
from shardwise.parallel.tensor.styles import check_style, linear_dims, linear_layout

TP2 = MeshLayout(("tp",), (2,))


class Conv1D(nn.Module):
    """Shaped like transformers' Conv1D (weight (nx, nf)), without importing transformers."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.weight, self.bias = nf, nn.Parameter(torch.randn(nx, nf)), nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias


class Declared(nn.Module):
    weight_layout = "in_out"

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(i, o))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def test_linear_layout_recognises_both_layouts():
    assert linear_layout(nn.Linear(3, 5)) == "out_in" and linear_dims(nn.Linear(3, 5)) == (3, 5)
    assert linear_layout(Conv1D(5, 3)) == "in_out" and linear_dims(Conv1D(5, 3)) == (3, 5)
    assert linear_layout(Declared(3, 5)) == "in_out" and linear_dims(Declared(3, 5)) == (3, 5)
    assert linear_layout(nn.LayerNorm(4)) is None and linear_layout(nn.Embedding(4, 4)) is None


def test_fused_column_checks():
    check_style("gu", nn.Linear(8, 16), None, sw.ColumnParallel(parts=2), 2, False)  # chunks of 8 over 2
    with pytest.raises(ValueError, match="each chunk's width must divide by tp"):
        check_style("gu", nn.Linear(8, 6), None, sw.ColumnParallel(parts=2), 2, False)  # chunks of 3 over 2
    parent = nn.Module()
    parent.num_heads, parent.split_size = 4, 7
    with pytest.raises(ValueError, match="'split_size' by tp=2"):
        check_style("c", Conv1D(24, 8), parent, sw.QKVParallel(4, head_attr="num_heads", divide_attrs=("split_size",)),
                    2, False)


class GQAFused(nn.Module):
    """q (4 heads) and k, v (2 heads each) in one Linear, cut into chunks of different widths."""

    def __init__(self, h: int = 256) -> None:
        super().__init__()
        self.head_dim = h // 4
        self.qkv, self.o = nn.Linear(h, h + 2 * (h // 2)), nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).split([h, h // 2, h // 2], dim=-1)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def test_auto_never_column_splits_uneven_fused_chunks():
    model = nn.Sequential(nn.Linear(256, 256), GQAFused(), nn.Linear(256, 256))
    plan = sw.auto(model, TP2, (torch.randn(2, 16, 256),))
    style = dict(plan).get("1.qkv")
    assert not isinstance(style, (sw.ColumnParallel, sw.QKVParallel)), str(plan)  # naive blocks would mix q, k
    assert "different widths" in str(plan)
