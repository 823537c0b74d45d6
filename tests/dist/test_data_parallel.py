"""sw.DataParallel on worlds of 2, 3, 4 ranks and a 2×2 mesh, against single-process references.

The rank-side checks live in tests/dist/dp_checks.py; each ``world.run`` covers many configurations.
Tolerances: fp32, relative 1e-5 against the one-process run (AdamW with eps=1e-5).
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.dist import dp_checks as dc

RTOL = 1e-5
ALGS = ["native", "ring", "tree"]


def _same_on_all_ranks(results: list, key: str = "hashes") -> None:
    assert all(res[key] == results[0][key] for res in results), [res[key] for res in results]


def _matrix(n: int) -> list[tuple]:
    """Every optimizer × overlap × algorithm at 2 ranks; a covering subset elsewhere (keeps the file fast)."""
    if n == 2:
        return [("mlp", opt, overlap, alg) for opt in ("sgd", "adamw") for overlap in (True, False) for alg in ALGS]
    subset = [("sgd", True, "native"), ("adamw", True, "ring"), ("sgd", False, "tree"), ("adamw", False, "native"),
              ("sgd", True, "ring"), ("adamw", True, "tree")]
    return [("mlp", *cfg) for cfg in (subset[:2] if n == 1 else subset)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_matches_one_process_on_full_batch(worlds, n):
    per_rank = worlds.get(n).run(dc.check_matches_full_batch, _matrix(n), timeout=240)
    for k, cfg in enumerate(_matrix(n)):
        results = [ranks[k] for ranks in per_rank]
        assert results[0]["cfg"] == cfg
        assert max(res["err"] for res in results) < RTOL, (cfg, [res["err"] for res in results])
        _same_on_all_ranks(results)
        assert all(res["counts_ok"] and res["stats_ok"] for res in results), (cfg, results[0])
        assert results[0]["buckets"] >= 3, "the small caps must produce several buckets"


def test_dp_axis_of_a_2x2_mesh(worlds):
    configs = [("mlp", "sgd", True, "native"), ("mlp", "adamw", True, "ring"), ("tied", "sgd", False, "tree")]
    per_rank = worlds.get(4).run(dc.check_matches_full_batch, configs, {"dp": 2, "tp": 2})
    for k in range(len(configs)):
        results = [ranks[k] for ranks in per_rank]
        assert max(res["err"] for res in results) < RTOL
        _same_on_all_ranks(results)  # both dp groups train identically, and each group agrees
        assert all(res["counts_ok"] for res in results)  # group size 2: the dp axis, not the world


@pytest.mark.parametrize("opt,views,set_to_none", [("sgd", True, True), ("adamw", True, False),
                                                    ("sgd", False, True), ("adamw", False, False)])
def test_no_sync_accumulation_equals_one_large_batch_step(worlds, opt, views, set_to_none):
    results = worlds.get(2).run(dc.check_no_sync, opt, views, set_to_none)
    for res in results:
        assert res["err"] < RTOL, res
        assert res["quiet"] == [0] * dc.STEPS  # no communication inside no_sync
        assert res["loud"] == [res["buckets"]] * dc.STEPS
    assert results[0]["hash"] == results[1]["hash"]


@pytest.mark.parametrize("n", [2, 3])
def test_unused_parameters_with_find_unused(worlds, n):
    results = worlds.get(n).run(dc.check_unused_found)
    assert results[0]["mixed"], "the data must make some ranks use the branch and others not"
    for res in results:
        assert res["err"] < RTOL, res
        assert res["never_grad_none"] and res["extra_grad"]  # torch semantics for globally/locally unused
        assert res["counts_ok"]  # no collective beyond one per bucket
    _same_on_all_ranks(results)


def test_unused_in_last_micro_step_keeps_accumulated_gradient(worlds):
    results = worlds.get(2).run(dc.check_unused_accumulated)
    for res in results:
        assert res["err"] < RTOL and res["extra_moved"], res
    assert results[0]["hash"] == results[1]["hash"]


@pytest.mark.parametrize("freeze_never", [False, True])
def test_unused_parameters_without_find_unused_raise_on_every_rank(worlds, freeze_never):
    messages = worlds.get(3).run(dc.check_unused_raises, freeze_never)
    for msg in messages:
        assert msg.startswith("step ") and "find_unused_parameters=True" in msg, msg
        assert "'extra.weight'" in msg if freeze_never else "'never.weight'" in msg, msg
    # With only the data-dependent branch unused, ranks that did use it raise too (instead of hanging).
    assert len({m.split(":")[0] for m in messages}) == 1, messages


def test_reentrant_checkpointing_is_refused(worlds):
    for msg in worlds.get(2).run(dc.check_reentrant_checkpoint_raises):
        assert "nested backward" in msg and "fc2." in msg, msg


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_tied_and_reused_parameters_reduced_once(worlds, opt):
    results = worlds.get(2).run(dc.check_tied, opt)
    for res in results:
        assert res["err"] < RTOL
        assert res["bytes"] == [res["expected"]] * dc.STEPS
        assert res["shared_once"]
    _same_on_all_ranks(results)


def test_parameter_averaging(worlds):
    results = worlds.get(3).run(dc.check_param_averaging)
    for res in results:
        assert res["err"] < RTOL  # period 1 + SGD == gradient averaging
        assert res["backward_comm"] == 0
        assert res["averaged"] == [True, 1] * dc.STEPS  # one all-reduce per average (one dtype)
    for k in range(dc.STEPS):
        equal = len({res["hashes"][k] for res in results}) == 1
        assert equal == (k % 2 == 1), (k, [res["hashes"][k] for res in results])


def test_batchnorm_buffers_broadcast(worlds):
    results = worlds.get(2).run(dc.check_batchnorm)
    for res in results:
        assert res["err"] < RTOL, res
        # float buffers + int64 num_batches_tracked: 2 broadcasts per forward; +1 (bucket order) at step 2
        assert res["broadcasts"] == [2, 3, 2, 2, 2]
    assert results[0]["hash"] == results[1]["hash"]


def test_comm_hooks(worlds):
    results = worlds.get(2).run(dc.check_hooks)
    for res in results:
        for name in ("bf16", "fp16"):
            assert res[name]["err"] < 2e-2, (name, res[name]["err"])
            assert res[name]["bytes"] * 2 == res[name]["full"]  # half the bytes on the wire
        spy = res["spy"]
        nb = len(spy["plan"])
        assert spy["indices"] == list(range(nb)) * 2 and spy["names"] == spy["plan"] and spy["shapes_ok"]
    for name in ("bf16", "fp16"):
        _same_on_all_ranks([res[name] for res in results])


def test_buckets_rebuilt_in_observed_order(worlds):
    results = worlds.get(2).run(dc.check_rebuild)
    for res in results:
        assert res["before"][0][0].startswith("a.") and res["after"][0][0].startswith("c."), res
        assert res["broadcasts"] == [0, 1, 0, 0, 0]
        assert res["err"] < RTOL
    _same_on_all_ranks(results)


def test_centralized_baseline(worlds):
    results = worlds.get(3).run(dc.check_centralized)
    for rank, res in enumerate(results):
        assert res["err"] < RTOL
        assert res["counts"] == [{"reduce": 1, "broadcast": 1}] * dc.STEPS
        assert res["has_optimizer"] == (rank == 0)
    _same_on_all_ranks(results)


def test_state_dict_uses_plain_keys(worlds):
    for res in worlds.get(2).run(dc.check_state_dict):
        assert res["keys_ok"] and res["loaded"]
        assert res["parent_keys"] == ["0.fc1.bias", "0.fc1.weight"]


def test_bad_inputs_raise_before_training(worlds):
    for res in worlds.get(2).run(dc.check_bad_inputs):
        assert res["complex"].startswith("TypeError") and "'z'" in res["complex"]
        assert res["device"].startswith("ValueError") and "'extra' (3,) is on the meta device" in res["device"]
        assert res["frozen"].startswith("ValueError") and res["axis"].startswith("ValueError")
        for key in ("{'bucket_cap_mb': 0}", "{'bucket_cap_mb': -1.0}", "{'first_bucket_mb': 0}", "{'period': 0}",
                    "{'average': 'both'}", "{'algorithm': 'bogus'}", "{'period': 2}"):
            assert res[key].startswith("ValueError"), (key, res[key])
        assert "already wrapped" in res["wrapper_twice"] and "already wrapped" in res["model_twice"]
        assert res["hook_param_avg"].startswith("ValueError") and res["hook_type"].startswith("TypeError")
        assert res["shape"].startswith("ValueError") and "fc2.weight" in res["shape"] and "17" in res["shape"]
        assert res["order"].startswith("ValueError") and "a.weight" in res["order"]


HAVE_GPT = importlib.util.find_spec("shardwise.models.gpt") is not None
HAVE_CKPT = importlib.util.find_spec("shardwise.parallel.common.activation_checkpointing") is not None


@pytest.mark.skipif(not HAVE_GPT, reason="shardwise.models.gpt not available yet")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_gpt_with_and_without_activation_checkpointing(worlds, checkpointing):
    if checkpointing and not HAVE_CKPT:
        pytest.skip("shardwise.parallel.common.activation_checkpointing not available yet")
    results = worlds.get(2).run(dc.check_gpt, checkpointing)
    for res in results:
        assert res["err"] < RTOL, res
        assert res["tied"] and res["buckets"] == [res["plan"]] * dc.STEPS
    assert results[0]["hash"] == results[1]["hash"]


def test_bench_dp_runs_end_to_end(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "dp.json"
    cmd = [sys.executable, "-m", "shardwise.cli", "bench", "dp", "-n", "2", "--preset", "gpt-tiny", "--steps", "1",
           "--warmup", "1", "--repeats", "1", "--variants", "torch-ddp,sw,centralized", "--sweep", "1",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 and ("Address already in use" in proc.stderr or "EADDRINUSE" in proc.stderr):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # a port race with other jobs
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"torch-ddp", "sw", "centralized", "sw-cap=1"}
    assert rows["sw"]["buckets"] >= 1 and rows["torch-ddp"]["vs_ddp"] == 1.0
