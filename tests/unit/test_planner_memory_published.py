"""The planner's memory against published memory figures (``benchmarks/planner/published_memory.py``): the
per-layer activation bytes of Korthikanti et al. 2022 Table 2, and the Llama 3 405B Table 4 layouts' breakdown.
Every expected number is derived here by hand from the papers' formulas and the models' shapes."""

from __future__ import annotations

import math

import pytest

from benchmarks.planner.published_llama3 import LLAMA3_TABLE4, llama3_prediction
from benchmarks.planner.published_memory import (TECHNIQUES, activation_memory_table, korthikanti_table2_bytes,
                                                 llama3_memory_rows, planner_layer_bytes)

# the 22B model of Korthikanti et al. 2022 (Table 3): 48 layers, h 6144, 64 heads, t 8; s 2048, b 1
S, H, A, T = 2048, 6144, 64, 8
SBH = S * H  # 12,582,912
ATTN = 5 * A * S / H  # 5as/h = 320/3


@pytest.mark.parametrize("technique, per_sbh", [
    ("none", 34 + ATTN), ("tp", 10 + 24 / T + ATTN / T), ("tp+sp", 34 / T + ATTN / T), ("full", 2.0)])
def test_the_planner_keeps_korthikantis_bytes_per_layer(technique, per_sbh):
    # Table 2 by hand: e.g. tp+sp = sbh·(34 + 5as/h)/t = 12,582,912 · 17.583 = 221,249,536 bytes (211 MiB)
    want = SBH * per_sbh
    assert korthikanti_table2_bytes(technique, s=S, b=1, h=H, a=A, t=T) == pytest.approx(want, rel=1e-12)
    assert planner_layer_bytes(technique, h=H, a=A, t=T, s=S) == pytest.approx(want, rel=1e-12)


def test_tp_sp_is_211_mib_for_the_22b_model():
    assert planner_layer_bytes("tp+sp", h=H, a=A, t=T) == 221_249_536


def test_the_table_grades_every_model_and_leaves_selective_ungraded_with_a_reason():
    rows = activation_memory_table()
    assert len(rows) == 4 * len(TECHNIQUES)
    graded = [r for r in rows if r.graded]
    assert {r.technique for r in graded} == {"none", "tp", "tp+sp", "full"}
    assert max(abs(r.error) for r in graded) < 1e-9
    assert all(r.reason for r in rows if not r.graded)
    # shardwise's selective recomputation (block input + weight GEMM outputs) against the paper's (attention core):
    # without sp it keeps the block input (s·h), the column-split GEMMs' outputs (qkv 3h/t, fc 4h/t) and the
    # row-split ones whole (proj h, fc_proj h): 2 bytes · (1 + 3/8 + 4/8 + 1 + 1) = 7.75 bytes per s·h
    sel = next(r for r in rows if r.model == "22B" and r.technique == "tp+selective")
    assert sel.predicted_bytes == pytest.approx(SBH * 7.75, rel=1e-12)
    assert sel.published_bytes == pytest.approx(SBH * (10 + 24 / 8), rel=1e-12)


# Llama 3 405B: s 8192, h 16384, 128 heads, 8 kv heads (k/v width 1024), ffn 53248, tp 8 with sp, bf16
LS, LH, LKV, LF, LT = 8192, 16384, 1024, 53248, 8
# kept elements per block on one rank: 4 norm/GEMM inputs (s·h, split by sp), q/k/v s·(h + 2·1024), the attention
# output and the o_proj input (2·s·h), gate, up, SiLU and product (4·s·f), all / t, and the flash kernel's
# log-sum-exp (128 heads · s / t) — in 2-byte elements
BLOCK = 2 * ((4 * LS * LH + LS * (LH + 2 * LKV) + 2 * LS * LH + 4 * LS * LF) / LT + 128 * LS / LT)
# local parameters of one block: (2h² + 2h·1024 + 3h·f) / t + the two norms' 2h
BLOCK_PARAMS = (2 * LH * LH + 2 * LH * LKV + 3 * LH * LF) / LT + 2 * LH


def test_llama3_block_bytes_are_derived_from_the_shapes():
    assert BLOCK == 675_545_088  # 0.629 GiB
    rows = llama3_memory_rows()
    assert rows[0]["block_gib"] * 2**30 == pytest.approx(BLOCK, rel=1e-12)


@pytest.mark.parametrize("row, held_chunks", [(0, 2 * (16 - 2) + (2 - 1) * 16 + 1), (1, 16 * 2), (2, 16 * 2)])
def test_llama3_stash_is_megatrons_interleaved_warm_up(row, held_chunks):
    """Pipeline rank 1 (the peak) holds 2 chunks of 4 blocks. Megatron's interleaved warm-up on rank r is
    2·(p − r − 1) + (V − 1)·p forwards, then one more before the first backward: 45 chunk sets at m = 32; at
    m = p = 16 every forward of the flush (16 · 2) comes first. Korthikanti §4.2.3's (1 + (p−1)/(p·V)) · L
    layers for the first stage is the same count: 126 · 1.47 = 185 blocks."""
    m = llama3_prediction(LLAMA3_TABLE4[row]).memory
    assert m.rank == 1
    assert m.activations == pytest.approx(held_chunks * 4 * BLOCK, rel=1e-9)


def test_llama3_model_states_on_the_peak_rank():
    """8 blocks on pipeline rank 1: bf16 parameters and gradients (2 + 2 bytes), 12 bytes of optimizer state
    sharded over dp × cp (ZeRO-1)."""
    for r in LLAMA3_TABLE4:
        m = llama3_prediction(r).memory
        n = 8 * BLOCK_PARAMS
        assert m.params == pytest.approx(2 * n, rel=1e-9)
        assert m.grads == pytest.approx(2 * n, rel=1e-9)
        assert m.optimizer == pytest.approx(12 * n / (r.dp * r.cp), rel=1e-9)


def test_llama3_what_if_numbers():
    rows = llama3_memory_rows()
    gib = 2**30
    for x in rows:
        # the activation stash is what is over 80 GB, and the 1F1B floor (126 blocks) alone is over too
        assert x["largest"] == "activations" and x["total"] > x["capacity"]
        assert x["one_f_one_b_floor"] * gib == pytest.approx(126 * BLOCK, rel=1e-12)
        assert x["one_f_one_b_floor"] > x["capacity"]
        # fp32 gradient accumulation: two more bytes per element with a gradient, on the paper's stage layout
        assert x["fp32_grads"] - x["paper_stages"] > 0
    # the CP row: all-gathered K and V (131,072 tokens · 2 · 1024 / 8 elements, bf16) for each of its 128 blocks
    assert rows[2]["kv_kept"] * gib == pytest.approx(128 * 131072 * 2 * LKV / LT * 2, rel=1e-9)
    assert rows[0]["kv_kept"] == 0.0
    # bytes per block that would fit: (80 GB − everything but the activations) / blocks held
    x = rows[1]
    rest = (x["total"] - x["activations"]) * gib
    assert x["fit_block_gib"] * gib == pytest.approx((80e9 - rest) / 128, rel=1e-9)
    assert math.isclose(x["blocks"], 128, rel_tol=1e-9)
