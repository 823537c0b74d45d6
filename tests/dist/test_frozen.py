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


# -- ZeRO-3 inside pipelines (pp 2 x dp 2): the frozen base sharded per unit (tests/dist/frozen_pipeline_checks.py)
WTE = fc.CFG.vocab_size * fc.CFG.n_embd  # the tied embedding/head: one copy on each pp coordinate that uses it


def _ceil_half(n: int) -> int:
    return (n + 1) // 2


@pytest.mark.parametrize("case", [dict(schedule="1f1b"), dict(schedule="zb-h1"), dict(schedule="1f1b", ckpt=True),
                                  dict(schedule="interleaved", chunks=2)], ids=str)
def test_pipeline_zero3_shards_the_frozen_base(worlds, case):
    from tests.dist import frozen_pipeline_checks as fpc

    per_rank = worlds.get(4).run(fpc.check_pipeline_zero3, case["schedule"], case.get("chunks", 1),
                                 case.get("ckpt", False), timeout=300)
    frozen_of_pp: dict[int, int] = {}
    for res in per_rank:
        _parity(res)
        assert res["eval_err"] < RTOL, res["eval_err"]
        assert res["frozen_in_buckets"] == [] and not res["frozen_master_grad"] and not res["frozen_in_optimizer"]
        assert res["state_numel"] == res["shard_numel"], res  # Adam's moments: the trainable shard only
        assert res["rs_bytes"] == [4 * res["bucket_numel"]] * fc.STEPS, res  # no frozen byte reduce-scattered
        assert res["held_between"] == [0] * fc.STEPS, res  # between steps every frozen parameter is empty
        frozen_units = [u["f_total"] for u in res["units"]]
        for u in res["units"]:  # each rank holds its half of every frozen unit
            assert u["f_shard"] <= _ceil_half(u["f_total"]), u
        assert all(s <= _ceil_half(t) for s, t in zip(res["held_frozen_shard"], res["held_frozen"])), res
        local = sum(frozen_units) + sum(res["held_frozen"])
        frozen_of_pp[res["pp"]] = local
        # while a step runs: at most two units' frozen groups (the running one, the prefetched one) plus the held
        two = sum(sorted(frozen_units)[-2:]) + sum(res["held_frozen"])
        assert 0 < res["max_resident"] <= two, res
        if sum(f > 0 for f in frozen_units) >= 3:
            assert res["max_resident"] < local, res  # never the whole frozen part of the rank at once
    for pp in (0, 1):  # the dp pair's shards add up to the groups: every frozen element on exactly one dp rank
        pair = [r for r in per_rank if r["pp"] == pp]
        for a, b in zip(pair[0]["units"], pair[1]["units"]):
            assert a["key"] == b["key"] and a["f_shard"] + b["f_shard"] == a["f_total"] == b["f_total"], (a, b)
    # every frozen parameter of the model is in some rank's groups; the tie is one copy per pp coordinate
    assert frozen_of_pp[0] + frozen_of_pp[1] == FROZEN + WTE, frozen_of_pp
    if case == dict(schedule="1f1b"):
        for res in per_rank:
            _check_gather_bytes(res)


def _check_gather_bytes(res: dict) -> None:
    """Per step over dp, in 4-byte elements: the held groups once, every unit's shards (trainable and frozen) in
    each micro-batch's forward, and again in its backward — except the embedding unit, frozen whole and fed token
    ids, whose output needs no gradient."""
    per_mb = sum((u["t_shard"] + u["f_shard"]) * (1 if u["name"] == "wte" else 2) for u in res["units"])
    want = 4 * (sum(res["held_trainable_shard"]) + sum(res["held_frozen_shard"]) + res["m"] * per_mb)
    assert res["ag_bytes"] == [want] * fc.STEPS, (res["ag_bytes"], want, res["units"])
    assert any(u["f_shard"] for u in res["units"])  # the frozen shards are in what was counted


def test_pipeline_zero3_checkpoint_with_frozen_base(worlds, tmp_path):
    from tests.dist import frozen_pipeline_checks as fpc

    per_rank = worlds.get(4).run(fpc.check_pipeline_zero3_checkpoint, str(tmp_path / "ckpt"), timeout=300)
    for res in per_rank:
        assert res["whole"] and res["slim"] and res["plain"], res
        assert res["written_once"], res  # each tensor's pieces add up to it once: no copy per dp replica
        assert "wte.weight" in res["frozen_written"] and "blocks.1.mlp.fc.weight" in res["frozen_written"], res
        assert res["slim_frozen"] == [], res  # train.save_frozen = false: no frozen shard in the file
        assert len(set(res["next_losses"])) == 1 and all(res["next_equal"]), res


def test_frozen_plans_put_a_frozen_weight_of_two_units_in_the_held_group():
    from types import SimpleNamespace

    import torch
    from torch import nn

    from shardwise.parallel.pipeline.zero3 import frozen_plans

    shared = nn.Linear(2, 2)  # used by both units (a tie inside one rank's stages)
    a, b = nn.Sequential(shared, nn.Linear(2, 2)), nn.Sequential(shared, nn.Linear(2, 2))
    for mod in (shared, a[1]):
        mod.requires_grad_(False)
    a[1].weight.data = a[1].weight.data.double()  # another dtype: stays whole, in no group
    stage = SimpleNamespace(units=[SimpleNamespace(modules=(("a", a),)), SimpleNamespace(modules=(("b", b),))])
    per_unit, held = frozen_plans({0: stage}, torch.float32)
    assert [n for n, _ in held] == ["a.0.weight", "a.0.bias"]
    assert {k: [n for n, _ in v] for k, v in per_unit.items()} == {(0, 0): ["a.1.bias"]}


def test_pipeline_zero3_frozen_base_in_bf16_mixed_precision(worlds, tmp_path):
    from tests.dist import frozen_pipeline_checks as fpc

    for res in worlds.get(4).run(fpc.check_pipeline_zero3_bf16, str(tmp_path / "ckpt"), timeout=300):
        # bf16 compute: losses close to fp32's (trained tensors not compared, as for sw.zero), frozen masters exact
        assert res["frozen_exact"] and res["trained"] and res["keys_ok"] and res["loss_err"] < 1e-3, res
        assert res["full_dtypes"] == ["torch.float32"], res
        assert res["frozen_compute"] == ["torch.bfloat16"] and res["frozen_master"] == ["torch.float32"], res
        assert 0 < res["frozen_shard_numel"] < res["frozen_total"] and res["held_between"] == 0, res  # sharded
        assert res["reloaded"], res


def test_pipeline_zero3_frozen_base_with_tp_inside(worlds, tmp_path):
    from tests.dist import frozen_pipeline_checks as fpc

    for res in worlds.get(8).run(fpc.check_pipeline_zero3_tp, str(tmp_path / "ckpt"), timeout=600):
        _parity(res)
        assert 0 < res["frozen_shard"] < res["frozen_total"] and res["held_between"] == 0, res  # sharded over dp
        assert res["reloaded"], res
