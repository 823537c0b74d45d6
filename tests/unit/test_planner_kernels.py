"""Fused attention and the loss priced from published kernel measurements (``planner/kernels.py``): the lookup
(nearest head dimension, log-sequence interpolation, clamping), every preset's numbers naming their source,
``_fused_core`` against a hand computation from the FlashAttention-3 paper's figures (pure, seconds)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from shardwise.planner import Hardware, Layout
from shardwise.planner.builders import gpt_layers
from shardwise.planner.compute import _fused_core, attention_time
from shardwise.planner.hardware import PRESETS
from shardwise.planner.kernels import (ATTENTION_TABLES, SEQS, attention_efficiency, attention_row,
                                       table_efficiency)
from shardwise.planner.layers import Gemm

H100 = Hardware.preset("h100-80g-sxm")
A100 = Hardware.preset("a100-80g-sxm")
BF16 = Layout(micro_batch=1, precision="bf16-mixed")

# Read off FlashAttention-3 (arXiv 2407.08608), H100 SXM5, BF16, the cuDNN bars: forward head dim 128 causal at
# 2K and 4K, and the non-causal forward and backward at 4K (the causal backward is derived from these).
CUDNN_FWD_128_CAUSAL_2K, CUDNN_FWD_128_CAUSAL_4K = 484.0, 518.0
CUDNN_FWD_128_4K, CUDNN_BWD_128_4K = 609.0, 499.0


def test_a_published_point_is_its_figure_over_the_peak():
    assert table_efficiency("h100-cudnn", 128, 4096, True, "fwd") == pytest.approx(CUDNN_FWD_128_CAUSAL_4K / 989)
    assert table_efficiency("h100-cudnn", 128, 4096, False, "bwd") == pytest.approx(CUDNN_BWD_128_4K / 989)


def test_interpolation_is_linear_in_log_sequence():
    mid = math.sqrt(2048 * 4096)
    expected = (CUDNN_FWD_128_CAUSAL_2K + CUDNN_FWD_128_CAUSAL_4K) / 2 / 989
    assert table_efficiency("h100-cudnn", 128, mid, True, "fwd") == pytest.approx(expected)
    quarter = 2048 * 2 ** 0.25
    expected = (0.75 * CUDNN_FWD_128_CAUSAL_2K + 0.25 * CUDNN_FWD_128_CAUSAL_4K) / 989
    assert table_efficiency("h100-cudnn", 128, quarter, True, "fwd") == pytest.approx(expected)


@pytest.mark.parametrize("table", sorted(ATTENTION_TABLES))
def test_outside_the_sweep_it_is_clamped(table):
    for causal in (False, True):
        for direction in ("fwd", "bwd"):
            row = attention_row(table, 128, causal, direction)
            assert table_efficiency(table, 128, 64, causal, direction) == pytest.approx(row.tflops[0] / 989)
            assert table_efficiency(table, 128, 131072, causal, direction) == pytest.approx(row.tflops[-1] / 989)


def test_the_nearest_head_dimension_is_used():
    assert attention_row("h100-cudnn", 80, True, "fwd").head_dim == 64
    assert attention_row("h100-cudnn", 96, True, "fwd").head_dim == 128  # nearer in log
    assert attention_row("h100-cudnn", 192, False, "fwd").head_dim == 256
    assert attention_row("h100-cudnn", 256, False, "bwd").head_dim == 128  # no published backward at 256


def test_causal_backward_is_derived_from_published_rows():
    row = attention_row("h100-cudnn", 128, True, "bwd")
    i = SEQS.index(4096)
    assert row.tflops[i] == pytest.approx(CUDNN_BWD_128_4K * CUDNN_FWD_128_CAUSAL_4K / CUDNN_FWD_128_4K, abs=0.05)
    assert row.source.startswith("derived:")


@pytest.mark.parametrize("table", sorted(ATTENTION_TABLES))
def test_every_row_names_its_source(table):
    t = ATTENTION_TABLES[table]
    assert t.peak_tflops == pytest.approx(H100.peak_flops["bf16"] / 1e12)
    keys = {(r.head_dim, r.causal, r.direction) for r in t.rows}
    assert len(keys) == len(t.rows)  # one row per (head dim, mask, direction)
    for r in t.rows:
        assert len(r.tflops) == len(SEQS) and all(0 < v < t.peak_tflops for v in r.tflops)
        assert "arXiv 2407.08608" in r.source and "H100" in r.source
        assert ("Fig. 5" in r.source) if r.direction == "fwd" else ("Fig. 6" in r.source)


def test_presets_name_their_tables_and_sources():
    for name, hw in PRESETS.items():
        if hw.attention_table:
            assert hw.attention_table in ATTENTION_TABLES
            assert "FlashAttention-3" in hw.source and "XLA" in hw.source  # attention and GEMM curve named
    assert PRESETS["h100-80g-sxm"].attention_table == PRESETS["h200-141g-sxm"].attention_table == "h100-cudnn"
    assert A100.attention_table == ""  # no published table recorded: the per-head-GEMM proxy


def test_bad_tables_and_directions_are_refused():
    with pytest.raises(ValueError, match="attention_table"):
        dataclasses.replace(H100, attention_table="h100-nope")
    with pytest.raises(ValueError, match="direction"):
        table_efficiency("h100-cudnn", 128, 4096, True, "sideways")
    with pytest.raises(ValueError, match="no attention table"):
        attention_efficiency(A100, 128, 4096, True, "fwd")


def test_sustained_fraction_scales_the_table():
    hw = dataclasses.replace(H100, sustained_fraction=0.9)
    assert attention_efficiency(hw, 128, 4096, True, "fwd") == pytest.approx(0.9 * CUDNN_FWD_128_CAUSAL_4K / 989)


def _cores(s: int, heads: int = 16, hd: int = 128) -> list[tuple[Gemm, float, float, float, float]]:
    scores = Gemm("scores", s, hd, s, "heads", batch=heads, weight=False, causal=True)
    context = Gemm("context", s, s, hd, "heads", batch=heads, weight=False, causal=True)
    return [(scores, s, s, hd, heads), (context, s, hd, s, heads)]


def test_fused_core_is_the_published_rate_by_hand():
    """s = 4096, 16 heads of 128, causal, bf16 on the H100 preset: FLOPs 4·s²·hd·heads / 2 at 518 TF/s forward,
    2.5× them at the derived causal backward rate; traffic O(s·h) well under the compute time."""
    s, heads, hd = 4096, 16, 128
    flops = 4.0 * s * s * hd * heads / 2
    sustained = H100.sustained_fraction  # the fitted share of the published rate the preset sustains
    fwd_rate = CUDNN_FWD_128_CAUSAL_4K * sustained
    bwd_rate = CUDNN_BWD_128_4K * CUDNN_FWD_128_CAUSAL_4K / CUDNN_FWD_128_4K * sustained
    io = 2 * (2 * s * hd * heads + 2 * s * hd * heads) + 4.0 * s * heads  # Q, K, V, O at 2 bytes + fp32 lse
    oh = H100.op_overhead_s
    assert io / H100.memory_bandwidth_Bps < flops / (fwd_rate * 1e12) / 4  # compute-bound
    fwd, bwd = _fused_core(_cores(s, heads, hd), H100, "bf16", 2)
    assert fwd == pytest.approx(flops / (fwd_rate * 1e12) + oh, rel=1e-3)
    assert bwd == pytest.approx(2.5 * flops / (bwd_rate * 1e12) + 2 * oh, rel=1e-3)


def test_fp32_and_tableless_devices_keep_the_proxy():
    proxy = dataclasses.replace(H100, attention_table="")
    assert _fused_core(_cores(4096), H100, "fp32", 4) == _fused_core(_cores(4096), proxy, "fp32", 4)
    f_t, b_t = _fused_core(_cores(4096), H100, "bf16", 2)
    f_p, b_p = _fused_core(_cores(4096), proxy, "bf16", 2)
    assert (f_t, b_t) != (f_p, b_p)
    oh = H100.op_overhead_s
    assert b_p - 2 * oh == pytest.approx(2.5 * (f_p - oh))  # the proxy's 2.5× rule


@pytest.mark.parametrize("hd", [64, 128, 256])
def test_core_time_grows_with_the_sequence_both_ways(hd):
    times = [_fused_core(_cores(s, 16, hd), H100, "bf16", 2) for s in (256, 512, 1024, 4096, 16384, 65536)]
    for (f0, b0), (f1, b1) in zip(times, times[1:]):
        assert f1 > f0 and b1 > b0


def test_attention_time_of_a_block_uses_the_table():
    block = gpt_layers(n_layer=1, h=2048, a=16, v=64, s=4096, positions=4096, tie=False, bias=False,
                       dropout=False, attention="flash")[1]
    f, b = attention_time(block, BF16, H100, flash=True)
    expected_f, expected_b = _fused_core(_cores(4096), H100, "bf16", 2)
    assert (f, b) == pytest.approx((expected_f, expected_b), rel=1e-12)
