"""The public API of ARCHITECTURE.md ("Public API") works exactly as written (names, keywords, return shapes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwise.models.gpt import GPT, GPTConfig, synthetic_batch
from tests.dist import api_checks as ac


def test_contract_on_a_2x2_mesh(worlds):
    results = worlds.get(4).run(ac.contract_calls, timeout=240)
    for rank, r in enumerate(results):
        assert r["size"] == 2 and r["coord"] == rank % 2 and r["group"] and r["axes"] == ("dp", "tp")
        assert r["shape"] == (2, 2)
        assert r["ring"] == [2.0] * 6 and r["gather"] == 4 and r["scatter"] == [2.0, 2.0]
        assert r["placements"] == ["S(0)", "B", "P"] and r["boxing"] and r["local_rows"] == 2
        assert r["dp_grads"] and r["tp_full_state"] and r["zero_full_state_keys"]
        assert r["memory_keys"] == ["grads", "optimizer", "params", "peak"]


def test_pipeline_step_returns_the_mean_loss_on_every_rank(worlds):
    losses = worlds.get(2).run(ac.pipeline_call, timeout=120)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16))
    idx, tgt = synthetic_batch(8, 16, 64, torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = float(F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten()))
    assert losses[0] == losses[1]
    assert abs(losses[0] - want) < 1e-5
