"""The activation stash of a pipeline rank counted by chunk (``pipeline_cost.held_bytes``): which chunks' sets
are live together follows the schedule's order, so a rank whose chunks keep different bytes (an embedding-only
chunk, a head-only chunk with its fp32 logits) is not priced as its peak count × the mean chunk. Expected values
are worked out by hand from Megatron's interleaved order (micro-batches in groups of p per chunk, backward from
the last chunk)."""

from __future__ import annotations

import pytest

from shardwise.planner.hardware import Hardware
from shardwise.planner.ledger import layout_floor
from shardwise.planner.pipeline_cost import first_forwards, held_bytes
from shardwise.planner.plan import Layout
from shardwise.planner.predict import predict
from shardwise.planner.spec import ModelSpec


def test_interleaved_p2_v2_m4_by_hand():
    """p = 2, V = 2, m = 4. Rank 0 (stages 0 and 2) runs F0 F0 F2 F2 F0 B2 F0 B2 F2 B0 F2 B0 …: its sets peak at
    3·s0 + 2·s2 (after the fifth forward) or 4·s0 + 1·s2 (after the sixth). Rank 1 (stages 1 and 3) runs
    F1 F1 F3 B3 F3 B3 F1 B1 …: 2·s1 + s3 or 3·s1."""
    assert held_bytes("interleaved", 2, 4, 2, [1.0, 10.0, 100.0, 1.0]) == (3 + 200, 30)
    assert held_bytes("interleaved", 2, 4, 2, [100.0, 10.0, 1.0, 1000.0]) == (401, 1020)


def test_one_chunk_and_gpipe_by_hand():
    # 1F1B: rank r holds p - r sets of its one stage; gpipe: every forward of the flush
    assert held_bytes("1f1b", 2, 4, 1, [5.0, 7.0]) == (10, 7)
    assert held_bytes("gpipe", 2, 4, 2, [1.0, 2.0, 3.0, 4.0]) == (4 * (1 + 3), 4 * (2 + 4))
    with pytest.raises(ValueError, match="one entry per stage"):
        held_bytes("1f1b", 2, 4, 1, [1.0])


def test_first_forwards_in_megatrons_order():
    assert first_forwards(2, 2, 5) == (3, 2)
    assert first_forwards(16, 2, 47) == (31, 16)  # Llama 3 Table 4's rank 0: 2·15 + 16 + 1 forwards
    assert first_forwards(4, 1, 4) == (4,)


# a GPT of 2 blocks on pp = 2 × 2 chunks: one unit per stage (wte | block 0 | block 1 | ln_f + head)
S, H, A, V = 64, 32, 2, 1000
SPEC = ModelSpec.gpt(n_layer=2, n_embd=H, n_head=A, vocab_size=V, seq_len=S, dropout=False)
PLAN = Layout(pp=2, chunks=2, schedule="interleaved", micro_batch=1, precision="bf16-mixed")
# kept bytes of one micro-batch: a block keeps 4·s·h (norm and GEMM inputs) + 13·s·h (q, k, v, the kernel's output,
# proj input, GELU input, fc_proj input) + a·s (log-sum-exp) 2-byte elements; the head keeps its norm input
# (2·s·h, 2 bytes) and the fp32 logits (s·v, 4 bytes); the embedding without dropout keeps nothing
BLOCK = (17 * S * H + A * S) * 2
HEAD = 2 * S * H * 2 + S * V * 4


def test_a_head_only_chunk_counts_once_per_set_it_holds():
    floors = layout_floor(SPEC, PLAN, global_batch=4)
    # rank 0 (wte, block 1): max(3·0 + 2·BLOCK, 4·0 + BLOCK); rank 1 (block 0, head): max(2·BLOCK + HEAD, 3·BLOCK)
    assert floors[0].activations == pytest.approx(2 * BLOCK, rel=1e-12)
    assert floors[1].activations == pytest.approx(2 * BLOCK + HEAD, rel=1e-12)
    # the peak count × the mean chunk would have said 3 · (BLOCK + HEAD) / 2 on rank 1
    assert floors[1].activations < 3 * (BLOCK + HEAD) / 2


def test_predict_prices_the_stash_by_chunk():
    mem = predict(SPEC, PLAN, Hardware.preset("h100-80g-sxm"), global_batch=4).memory
    assert mem.rank == 1
    assert mem.activations == pytest.approx(2 * BLOCK + HEAD, rel=1e-12)
