"""The Llama family under tensor parallelism with sequence parallelism on a world of 2 ranks: the norms and
residuals hold S(seq) over tp, the q/k/v projections all-gather the sequence and the attention builds its rotary
tables from the gathered queries' length. Forward (logits, loss) and every gradient equal one device (fp32, rel
1e-5), over several SGD steps; with activation checkpointing; an odd sequence length (uneven pieces). Rank side:
tests/dist/hf_sp_checks.py."""

from __future__ import annotations

import pytest

from tests.dist import hf_sp_checks as sc

L = 2  # layers of both example configs


@pytest.mark.parametrize("example, tied", [("tiny-llama.json", None), ("tiny-llama.json", True),
                                           ("tiny-qwen2.json", None)])
def test_tp2_sp_matches_single_device(worlds, example, tied):
    # llama: GQA 4/2, untied head (and tied); qwen2: q/k/v biases, tied embedding, vocabulary 301 (151 + 150)
    errs = worlds.get(2).run(sc.check_sp_parity, example, tied)
    assert all(max(e.values()) < 1e-5 for e in errs), errs


@pytest.mark.parametrize("example", ["tiny-llama.json", "tiny-qwen2.json"])
def test_tp2_sp_with_activation_checkpointing_and_uneven_sequence(worlds, example):
    worlds.get(2).run(sc.check_sp_parity, example, None, True, 15)


def test_tp2_sp_collective_pattern(worlds):
    fwd, bwd = worlds.get(2).run(sc.check_sp_comm, "tiny-llama.json")[0]
    # forward: the embedding reduce-scatters to S(seq); per layer one all-gather for q/k/v (one conversion shared
    # by the three projections), one for gate/up, a reduce-scatter after o_proj and down_proj; the head's
    # all-gather; the loss's two all-reduces
    assert fwd == {"reduce_scatter": 1 + 2 * L, "all_gather": 2 * L + 1, "all_reduce": 2}
    # backward: the transposes of those, plus one all-reduce per gradient region of the replicated RMSNorm
    # weights (each layer's two norms, then model.norm)
    assert bwd == {"reduce_scatter": 2 * L + 1, "all_gather": 1 + 2 * L, "all_reduce": L + 1}
