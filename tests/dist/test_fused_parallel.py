"""Transposed linear layers (transformers' ``Conv1D``) and fused projections (q/k/v in one matrix, gate/up in one
matrix) under ``sw.parallelize`` and ``sw.auto``, against one device (fp32, rtol 1e-5). Rank-side code:
tests/dist/fused_checks.py."""

from __future__ import annotations

import importlib.util

import pytest

from tests.dist import fused_checks as fc

H = 256  # n_embd of the test models (4 heads of 64)
needs_hf = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")

GPT2_BLOCKS = {"transformer.h.*.attn.c_attn": "QKVParallel(n_head=4, head_attr='num_heads', divide_attrs=('split_size',))",
               "transformer.h.*.attn.c_proj": "RowParallel()", "transformer.h.*.mlp.c_fc": "ColumnParallel(heads=None)",
               "transformer.h.*.mlp.c_proj": "RowParallel()"}


@needs_hf
def test_gpt2_auto_tp2_splits_the_blocks(worlds):
    a, b = worlds.get(2).run(fc.check_auto, "gpt2", 1, timeout=60)
    assert a["styles"] == b["styles"] and a["planning_comms"] == 0
    assert {k: v for k, v in a["styles"].items() if ".h." in k} == GPT2_BLOCKS, a["styles"]
    # Conv1D weights are (in, out): c_attn keeps whole heads of q, k and v — its columns halve; c_proj its rows
    assert a["shapes"]["transformer.h.0.attn.c_attn.weight"] == (H, 3 * H // 2)
    assert a["shapes"]["transformer.h.0.attn.c_proj.weight"] == (H // 2, H)
    assert a["shapes"]["transformer.h.0.mlp.c_fc.weight"] == (H, 4 * H // 2)
    assert a["fwd_tp"] >= 2 * 2  # one all-reduce per column -> row pair per layer (plus any vocab ones)


@needs_hf
def test_gpt2_auto_dp2_tp2(worlds):
    results = worlds.get(4).run(fc.check_auto, "gpt2", 2, timeout=60)
    assert all(r["styles"] == results[0]["styles"] for r in results) and results[0]["dp"] == ("dp",)
    assert {k: v for k, v in results[0]["styles"].items() if ".h." in k} == GPT2_BLOCKS


@needs_hf
def test_gpt2_hand_plan_one_sgd_step(worlds):
    a, _ = worlds.get(2).run(fc.check_gpt2_hand_plan, timeout=60)
    assert a["split_size"] == H // 2  # the attention now cuts its local [q | k | v] by h/tp
    assert a["shapes"]["transformer.h.0.mlp.c_proj.weight"] == (4 * H // 2, H)


def test_fused_qkv_and_gate_up_auto_tp2(worlds):
    a, _ = worlds.get(2).run(fc.check_auto, "fused", 1, timeout=60)
    assert a["styles"]["blocks.*.attn.qkv"] == "ColumnParallel(heads=4, parts=3)", a["styles"]
    assert a["styles"]["blocks.*.mlp.gate_up"] == "ColumnParallel(heads=None, parts=2)", a["styles"]
    assert a["styles"]["blocks.*.attn.proj"] == a["styles"]["blocks.*.mlp.down"] == "RowParallel()"
    assert a["shapes"]["blocks.0.attn.qkv.weight"] == (3 * H // 2, H)


@needs_hf
def test_gpt2_meta_device_pieces_equal_one_process(worlds):
    a, b = worlds.get(2).run(fc.check_gpt2_meta, timeout=60)
    assert a["keys"] and a["differs"] == [] and b["differs"] == [], (a["differs"], b["differs"])
    assert a["c_attn"] == (H, 3 * H // 2)
