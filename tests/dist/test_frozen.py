"""Frozen parameters (``requires_grad=False``) in every layout, against one process training the same GPT with
plain AdamW over its trainable parameters (tests/dist/frozen_checks.py).

Every layout: losses and trained tensors within 1e-5 relative, frozen tensors bit-identical to the untrained
start, and none of the frozen bytes in a gradient collective, a gradient buffer or an optimizer state.
"""

from __future__ import annotations

import pytest

from tests.dist import frozen_checks as fc

RTOL = 1e-5
TRAINABLE = sum(p.numel() for p in fc.build().parameters() if p.requires_grad)
N_TRAINABLE = sum(p.requires_grad for p in fc.build().parameters())
FROZEN = sum(p.numel() for p in fc.build().parameters() if not p.requires_grad)


def _parity(res: dict) -> None:
    assert res["loss_err"] < RTOL and res["param_err"] < RTOL, res
    assert res["frozen_exact"] and res["trained"] and res["keys_ok"], res


def test_model_is_half_frozen():
    # the test model: a frozen base bigger than what trains, and a module with a frozen weight and trainable bias
    assert FROZEN > TRAINABLE > 0
    flags = {n: p.requires_grad for n, p in fc.build().named_parameters()}
    assert flags["blocks.0.attn.proj.bias"] and not flags["blocks.0.attn.proj.weight"]


def test_data_parallel(worlds):
    for res in worlds.get(2).run(fc.check_data_parallel, timeout=120):
        _parity(res)
        # the bucket buffers: the trainable gradients plus one status flag per trainable parameter (reducer.py)
        assert res["slots"] == TRAINABLE + N_TRAINABLE, res
        assert res["sent"] == [4 * (TRAINABLE + N_TRAINABLE)] * fc.STEPS, res
        assert res["frozen_grads"] == 0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero(worlds, stage):
    per_rank = worlds.get(2).run(fc.check_zero, stage, timeout=120)
    for res in per_rank:
        _parity(res)
        assert res["frozen_in_groups"] == [], res
        assert res["rs_bytes"] == [4 * TRAINABLE] * fc.STEPS, res  # one reduce-scatter input per trainable byte
        assert res["gathered_after_backward"] == [0] * fc.STEPS if stage == 3 else True
    # Adam's two moments exist for this rank's shard of the trainable parameters only
    assert sum(r["state_numel"] for r in per_rank) == TRAINABLE
    if stage < 3:
        assert all(r["frozen_numel_held"] == FROZEN for r in per_rank)  # whole, as the model holds them
        return
    for res in per_rank:  # ZeRO-3: the frozen base sharded too, nothing of it held whole
        assert res["frozen_numel_held"] == 0, res
        assert sum(res["frozen_units"]) == FROZEN
        assert res["memory"]["grads"] <= 4 * sum(res["trainable_shard_numel"]), res
        # forward gathers every group's shard, backward the block units again (not the rest: kept since forward)
        t, f = res["trainable_shard_numel"], res["shard_numel"]
        assert res["ag_bytes"] == [4 * (2 * sum(t) + 2 * sum(f) - t[0] - f[0])] * fc.STEPS, res
        # at most the rest unit and two block units (the running one, the prefetched one) of frozen weights
        blocks = sorted(res["frozen_units"][1:])
        assert res["max_frozen_resident"] <= res["frozen_units"][0] + sum(blocks[-2:]) < FROZEN, res
    assert sum(sum(r["shard_numel"]) for r in per_rank) == FROZEN


@pytest.mark.parametrize("sp", [False, True])
def test_tensor_parallel(worlds, sp):
    for res in worlds.get(2).run(fc.check_tensor_parallel, sp, timeout=120):
        _parity(res)
        assert res["flags_ok"] and res["frozen_grads"] == 0, res


def test_pipeline(worlds):
    per_rank = worlds.get(2).run(fc.check_pipeline, timeout=120)
    for res in per_rank:
        _parity(res)
        assert res["state_numel"] == res["trainable_local"], res  # no moments for a frozen (tied) weight
    assert sum(r["trainable_local"] for r in per_rank) == TRAINABLE


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_pipeline_with_dp(worlds, zero):
    # pp 2 x dp 2: the dp reduction carries the stage's trainable gradients (and the loss's one float), not more
    per_rank = worlds.get(4).run(fc.check_pipeline, zero, timeout=180)
    for res in per_rank:
        _parity(res)
        assert res["frozen_in_buckets"] == [], res
        assert res["dp_bytes"] == [4 * res["bucket_numel"] + 4] * fc.STEPS, res
    assert per_rank[0]["bucket_numel"] + per_rank[-1]["bucket_numel"] == TRAINABLE
    assert sum(r["state_numel"] for r in per_rank) == (2 if zero == 0 else 1) * TRAINABLE


def test_checkpointed_blocks_after_frozen_embedding(worlds):
    # reentrant checkpointing would give the blocks no gradient here: their inputs do not require grad
    for res in worlds.get(2).run(fc.check_checkpointed_frozen_inputs, timeout=120):
        _parity(res)
        assert res["grads"] == res["trainable"] == N_TRAINABLE, res


def test_everything_frozen_is_one_line_error(worlds):
    res = worlds.get(2).run(fc.check_all_frozen, timeout=60)[0]
    for name, msg in res.items():
        assert msg.startswith("ValueError:") and "every parameter is frozen" in msg and "\n" not in msg, (name, msg)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_without_frozen_base(worlds, tmp_path, stage):
    # tmp_path differs per parametrisation; every rank writes under the same directory
    per_rank = worlds.get(2).run(fc.check_checkpoint, str(tmp_path / "ckpt"), stage, timeout=120)
    res = per_rank[0]
    assert "wte.weight" in res["frozen"] and "blocks.1.mlp.fc.weight" in res["frozen"], res
    assert res["written_once"], res  # each frozen tensor's pieces add up to it once (no copy per dp replica)
    assert res["aliases_only"] == ["lm_head.weight"], res  # the tie: saved under wte.weight only
    assert res["slim_keys"] == [], res
    for r in per_rank:
        assert r["zero_equal"] and r["plain_equal"], r
        assert "left out the frozen parameter 'wte.weight'" in r["missing"] and "model.pretrained" in r["missing"], r


def test_zero3_mixed_precision_and_offload(worlds):
    for res in worlds.get(2).run(fc.check_zero3_variants, timeout=120):
        bf16, off = res["bf16"], res["offload"]
        # bf16 compute: the losses close to fp32's (Adam's early steps turn bf16 gradient noise into whole steps,
        # so the trained tensors are not compared), the frozen fp32 masters exact
        assert bf16["frozen_exact"] and bf16["trained"] and bf16["loss_err"] < 1e-3, bf16
        _parity(off)
        for r in (bf16, off):
            assert 0 < r["frozen_master_numel"] < FROZEN and not r["frozen_master_grad"], r
