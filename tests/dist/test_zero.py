"""sw.zero on worlds of 2 and 4 ranks against one-process plain-PyTorch training of the same weights.

Rank-side checks live in tests/dist/zero_checks.py; each ``world.run`` covers many configurations.
Tolerance: fp32, per-tensor relative error 1e-5 (as in the DataParallel tests; AdamW with eps=1e-5).
Memory: model-state bytes within 5% of the ZeRO formulas.
"""

from __future__ import annotations

import pytest

from tests.dist import zero_checks as zc

RTOL = 1e-5


def _matrix(n: int) -> list[tuple]:
    """Every stage x optimizer x model on both world sizes; clipping and accumulation (no_sync) on the GPT
    on both; accumulation on the odd-sized model and activation checkpointing on 2 ranks only (time)."""
    cfgs = [(kind, opt, stage, "plain") for kind in ("uneven", "gpt") for opt in ("sgd", "adamw")
            for stage in (1, 2, 3)]
    cfgs += [("gpt", opt, stage, variant) for opt, variant in (("adamw", "clip"), ("sgd", "accum"))
             for stage in (1, 2, 3)]
    if n == 2:
        cfgs += [("uneven", "sgd", stage, "accum") for stage in (1, 2, 3)]
        cfgs += [("gpt-ckpt", "adamw", stage, "ckpt") for stage in (1, 2, 3)]
        cfgs += [("gpt", "adamw", 3, "units"), ("gpt", "sgd", 2, "serial"), ("gpt", "sgd", 3, "serial")]
        # offload (host == device on CPU ranks: the same numbers), with clipping and accumulation
        cfgs += [("gpt", "adamw", stage, "offload") for stage in (1, 2, 3)] + [("gpt", "adamw", 3, "offload-params"),
                                                                            ("gpt", "sgd", 3, "offload-accum")]
    return cfgs


@pytest.mark.parametrize("n", [2, 4])
def test_stages_match_one_process(worlds, n):
    per_rank = worlds.get(n).run(zc.check_parity, _matrix(n), timeout=300)
    for k, cfg in enumerate(_matrix(n)):
        results = [ranks[k] for ranks in per_rank]
        assert results[0]["cfg"] == cfg
        for res in results:
            assert res["err"] < RTOL, (cfg, res["err"])
            assert res["keys_ok"], cfg
            assert res["norms_ok"], cfg  # clip_grad_norm_ returns the global norm of the one-process run
            if "counts_ok" in res:
                assert res["counts_ok"], (cfg, res["phases"])
            if "quiet" in res:
                assert res["quiet"], cfg  # no reduce-scatter in the no_sync micro-batch's backward
        if cfg[3] == "units":  # the tie left its two units for the rest; ln_f got a unit of its own
            names = results[0]["group_names"]
            assert names[0][:2] == ["wte.weight", "wpe.weight"] and len(names) == 3, names
            assert names[2] == ["ln_f.weight"], names
        if cfg[3] == "plain" and cfg[2] in (1, 2):
            assert results[0]["groups"] >= 2, "small buckets must give several flat groups"


def test_stage3_collectives_per_step(worlds):
    # GPT with 2 blocks: units rest, b0, b1 -> forward 3 all-gathers, backward 2 all-gathers (blocks again)
    # and 3 reduce-scatters, no collective in step; with activation checkpointing the same.
    per_rank = worlds.get(2).run(zc.check_parity, [("gpt", "sgd", 3, "plain"), ("gpt-ckpt", "sgd", 3, "ckpt")])
    for res in per_rank[0]:
        assert res["phases"] == {"forward": {"all_gather": 3}, "backward": {"all_gather": 2, "reduce_scatter": 3},
                                 "backward0": {"all_gather": 2, "reduce_scatter": 3}, "step": {}}, res["phases"]
        assert res["err"] < RTOL


@pytest.mark.parametrize("n", [2, 4])
def test_memory_matches_formulas(worlds, n):
    per_rank = worlds.get(n).run(zc.check_memory)
    for res in per_rank[0] + per_rank[-1]:
        assert res["rel"] < 0.05, res
    stage3 = [r for r in per_rank[0] if r["case"] == "stage3-fp32"][0]
    assert stage3["got"]["params"] < stage3["want"] / 2  # parameters really sharded, not just state


def test_load_full_state_dict_into_every_stage(worlds):
    for n in (2, 4):
        for res in worlds.get(n).run(zc.check_load, [1, 2, 3])[0]:
            assert res["loaded"], res
            assert res["eval_err"] < 1e-5 and res["freed"], res  # no_grad forward: same logits, units freed
            assert res["err"] < RTOL, res
            assert res["missing"].startswith("ValueError") and "wpe.weight" in res["missing"], res


def test_mixed_precision(worlds):
    for res in worlds.get(2).run(zc.check_mixed, "gpt"):
        assert res["stage_spread"] == 0.0, res  # N=2: stages 1 and 3 compute the same bf16 numbers
        assert res["dtypes"] == ["torch.float32"], res  # full_state_dict returns the fp32 master
        assert 1e-6 < res["bf16_err"] < 0.05, res  # bf16 compute: close to fp32, but not equal
        # 2**20 overflows fp16 at first: skipped steps halve the scale, then steps are taken
        assert res["took"][0] is False and res["scales"][0] == 2.0**19, res
        assert sum(res["took"]) >= 3, res
        assert res["fp16_err"] < 0.05, res


def test_bad_input(worlds):
    out = worlds.get(2).run(zc.check_bad_input)[0]
    for key in ("stage=0", "stage=4", "stage='2'", "stage=True"):
        assert out[key].startswith("ValueError") and "stage must be one of [1, 2, 3]" in out[key], out[key]
    for key in ("optimizer-instance", "optimizer-class", "optimizer-returns", "optimizer-int"):
        assert out[key].startswith("TypeError") and "torch.optim" in out[key], out[key]
    for key in ("wrapped-twice", "inner-twice", "data-parallel"):
        assert out[key].startswith("ValueError") and "already wrapped" in out[key], out[key]
    assert out["mixed-dtypes"].startswith("ValueError") and "torch.float64" in out["mixed-dtypes"]
    assert out["meta-no-source"].startswith("ValueError") and "'extra.w'" in out["meta-no-source"]
    assert "nothing says how to initialise it" in out["meta-no-source"]
    assert out["algorithm"].startswith("ValueError") and "'fast'" in out["algorithm"] and "ring" in out["algorithm"]
    assert out["unit-name"].startswith("ValueError") and "blocks.9" in out["unit-name"]
    assert out["unit-container"].startswith("ValueError") and "ModuleList" in out["unit-container"]
    assert out["offload-params-stage2"].startswith("ValueError") and "use stage=3" in out["offload-params-stage2"]
    assert out["offload-unknown"].startswith("ValueError") and "'disk'" in out["offload-unknown"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_accumulation_misuse_raises(worlds, stage):
    out = worlds.get(2).run(zc.check_accumulation_errors, stage)[0]
    assert out["step-inside"].startswith("RuntimeError") and "no_sync" in out["step-inside"]
    assert out["clip-inside"].startswith("RuntimeError") and "no_sync" in out["clip-inside"]
    # every stage reduces in backward: a step after only no_sync backwards would drop local gradients
    assert out["step-unreduced"].startswith("RuntimeError") and "never reduced" in out["step-unreduced"]
    assert out["backward-after-clip"].startswith("RuntimeError") and "clip_grad_norm_" in out["backward-after-clip"]


def test_stage3_keeps_few_units_gathered(worlds):
    for res in worlds.get(2).run(zc.check_stage3_residency):
        assert res["groups"] == 5 and res["calls"] == 9, res  # rest + 4 blocks; 1 + 4 forward + 4 backward
        # the rest unit, the unit in use and the one being prefetched: never the whole model
        assert res["max_resident"] == 3, res
        assert res["after_backward"] == 0, res  # everything freed when backward ends
        # gradients: each parameter's copied into its unit's flat and dropped at once; one unit filling and one
        # reducing at most; the averaged shards live from backward to the step, which releases them
        assert res["grads_left"] == 0 and res["max_flats"] <= 2 and res["in_flight"] == 1, res
        assert res["shards_after_backward"] == 5 and res["shards_after_step"] == 0, res
