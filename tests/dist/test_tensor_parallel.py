"""Tensor parallelism: GPT training parity with one device (tp = 2, 3, 4 and dp x tp = 2 x 2, with and
without sequence parallelism), collective counts, vocab-parallel cross-entropy, RNG streams, bad input."""

from __future__ import annotations

import pytest

from tests.dist import tp_checks as tc

L = tc.TINY["n_layer"]
F32 = 4  # bytes per fp32 gradient element


@pytest.mark.parametrize("sp", [False, True])
def test_tp2_training_matches_single_device(worlds, sp):
    w = worlds.get(2)
    losses = w.run(tc.check_training_parity, {"tp": 2}, {}, sp)
    assert losses[0] == losses[1]  # the loss is replicated over tp
    # an uneven vocabulary (255 = 128 + 127 rows) and uneven sequence pieces (15 = 8 + 7 tokens)
    w.run(tc.check_training_parity, {"tp": 2}, {"vocab_size": 255}, sp, seq=15)
    # no biases anywhere, and an untied head (its own vocab-sharded weight)
    w.run(tc.check_training_parity, {"tp": 2}, {"bias": False, "tie_weights": False}, sp)


def test_tp3_uneven_vocab_and_sequence(worlds):
    # 3 heads over tp=3; vocabulary 256 -> 86/85/85 rows; sequence 16 -> 6/5/5 tokens with SP
    w = worlds.get(3)
    for sp in (False, True):
        w.run(tc.check_training_parity, {"tp": 3}, {"n_head": 3, "n_embd": 48}, sp)
    assert w.run(tc.check_vocab_ce, 7)[0] > 0


@pytest.mark.parametrize("axes", [{"tp": 4}, {"dp": 2, "tp": 2}])
def test_world4_training_matches_single_device(worlds, axes):
    w = worlds.get(4)
    for sp in (False, True):
        w.run(tc.check_training_parity, axes, {}, sp)


def test_collective_counts(worlds):
    w = worlds.get(2)
    fwd, bwd, _ = w.run(tc.check_comm_counts, False)[0]
    # forward: embedding all-reduce, 2 row-parallel all-reduces per block, loss max + (sum-exp, target)
    assert fwd == {"all_reduce": 1 + 2 * L + 2}
    # backward: column-parallel inputs (qkv, fc) per block + the LM head input; loss and row outputs: none
    assert bwd == {"all_reduce": 2 * L + 1}
    fwd, bwd, ar_bytes = w.run(tc.check_comm_counts, True)[0]
    # SP forward: embedding reduce-scatter; per block 2 gathers before qkv/fc and 2 reduce-scatters after
    # the row layers; the LM head's gather; the loss's 2 all-reduces
    assert fwd == {"reduce_scatter": 1 + 2 * L, "all_gather": 2 * L + 1, "all_reduce": 2}
    # SP backward: the conjugates, plus ONE all-reduce per gradient region of replicated parameters with a
    # partial gradient (not one per parameter): ln_f, each block, wpe -- in backward order
    assert bwd == {"all_gather": 1 + 2 * L, "reduce_scatter": 2 * L + 1, "all_reduce": L + 2}
    h, t = tc.TINY["n_embd"], tc.TINY["block_size"]
    # ln_f: weight + bias (2h); a block: ln_1 and ln_2 weight + bias (4h), attn.proj and mlp.proj biases (2h);
    # wpe: its whole (block_size, h) table (an embedding's gradient is dense)
    assert ar_bytes == [F32 * 2 * h] + [F32 * 6 * h] * L + [F32 * t * h]
    # without biases: the norm weights only (h each), no row biases
    _, bwd, ar_bytes = w.run(tc.check_comm_counts, True, {"bias": False})[0]
    assert bwd["all_reduce"] == L + 2
    assert ar_bytes == [F32 * h] + [F32 * 2 * h] * L + [F32 * t * h]


@pytest.mark.parametrize("vocab", [8, 9, 1])
def test_vocab_parallel_cross_entropy(worlds, vocab):
    losses = worlds.get(2).run(tc.check_vocab_ce, vocab)
    assert losses[0] == losses[1]


@pytest.mark.parametrize("sp", [False, True])
def test_rng_streams(worlds, sp):
    a, b = worlds.get(2).run(tc.check_rng_streams, sp)
    assert a["head_region"] != b["head_region"]  # split (local heads): independent draws
    assert a["after_forward"] == b["after_forward"]  # the shared stream continues in step
    if sp:  # everything outside column->row pairs is sequence-split: independent masks
        assert a["embed_drop"] != b["embed_drop"] and a["resid_drop"] != b["resid_drop"]
    else:  # replicated activations: identical masks
        assert a["embed_drop"] == b["embed_drop"] and a["resid_drop"] == b["resid_drop"]


@pytest.mark.parametrize("sp", [False, True])
def test_checkpointing_replays_split_dropout(worlds, sp):
    worlds.get(2).run(tc.check_checkpoint_dropout, sp)


def test_bad_input(worlds):
    msgs = worlds.get(2).run(tc.check_bad_input)[0]
    assert "matches no module" in msgs[0] and "blocks.0" in msgs[0]
    assert "nn.Linear" in msgs[1] and "LayerNorm" in msgs[1]
    assert "CausalSelfAttention" in msgs[2]
    assert "3 attention heads" in msgs[3] and "tp=2" in msgs[3]
    assert "tied" in msgs[4] and "lm_head.weight" in msgs[4]
    assert "SequenceParallel" in msgs[5] and "ln_1" in msgs[5]
    assert "sequence_parallel=True" in msgs[6]
    assert "'dp'" in msgs[7]
    assert "already tensor-parallel" in msgs[9]
    assert "vocabulary columns" in msgs[10]
