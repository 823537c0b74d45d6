"""HF decoders (``--model.hf_config``'s model) under tensor parallelism and the pipeline on a world of 2 ranks,
against one-device SGD training of the same weights (fp32, rtol 1e-5), with the collective pattern counted.
Rank-side code: tests/dist/hf_checks.py."""

from __future__ import annotations

import pytest

from tests.dist import hf_checks as hc

L = 2  # layers of both example configs
F32, H = 4, 64


@pytest.mark.parametrize("example", ["tiny-llama.json", "tiny-qwen2.json"])
def test_tp2_training_matches_single_device(worlds, example):
    # llama: GQA 4/2, untied head; qwen2: q/k/v biases, tied embedding, vocabulary 301 (151 + 150 rows)
    losses = worlds.get(2).run(hc.check_tp_parity, example)
    assert losses[0] == losses[1]  # the loss is replicated over tp


def test_tp2_collective_pattern(worlds):
    fwd, bwd, fwd_bytes = worlds.get(2).run(hc.check_tp_comm, "tiny-llama.json")[0]
    # forward: the embedding's all-reduce, one per row-parallel layer (o_proj, down_proj), the loss's two
    assert fwd == {"all_reduce": 1 + 2 * L + 2}
    batch, seq = 2, hc.SEQ
    # each hidden-state all-reduce moves the whole (b, t, h) fp32 activation; the loss's: (b·t) maxima, then the
    # (b·t) sums of exponentials with the (b·t) target logits
    assert fwd_bytes == F32 * batch * seq * (H * (1 + 2 * L) + 3), fwd_bytes
    # backward: the input gradient of each group of column-parallel layers reading one tensor — q, k, v (three
    # Linears, as HF names them) share one all-reduce, gate and up another: 2 per layer, as Megatron's fused
    # qkv and gate_up — and the LM head's input
    assert bwd == {"all_reduce": 2 * L + 1}


@pytest.mark.parametrize("schedule, split", [("1f1b", None), ("zb-h1", ["model.layers.1"]),
                                             ("gpipe", ["model.norm"])])
def test_pipeline_matches_single_device(worlds, schedule, split):
    # the tied qwen2 head sits on the last stage, its embedding on the first
    worlds.get(2).run(hc.check_pipeline_parity, "tiny-qwen2.json", schedule, split)
