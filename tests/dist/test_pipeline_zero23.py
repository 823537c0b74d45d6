"""ZeRO-2 and ZeRO-3 inside pipelines against one-device training of the same GPT (fp32, rtol 1e-5), every
schedule: gradients reduce-scattered once per step per stage, ZeRO-2's full gradient buffers and ZeRO-3's gathered
units released, ZeRO-3's parameters gathered per unit as the schedule runs them. Rank side:
tests/dist/pipeline_hybrid_checks.py (the same runner as ZeRO-1's cases).
"""

from __future__ import annotations

import pytest

from tests.dist import pipeline_hybrid_checks as hc

RTOL = 1e-5
PP_DP = dict(pp=2, dp=2)

CASES = [
    dict(axes=PP_DP, schedule="1f1b", n_layer=2, m=3, zero=2, opt="adamw"),
    dict(axes=PP_DP, schedule="zb-h1", n_layer=2, m=3, zero=2, accum=2, clip=0.5),
    dict(axes=PP_DP, schedule="1f1b", n_layer=3, m=3, zero=3, opt="adamw", eval=True),
    dict(axes=PP_DP, schedule="gpipe", n_layer=2, m=2, zero=3, clip=0.5),
    dict(axes=PP_DP, schedule="zb-h1", n_layer=2, m=3, zero=3, opt="adamw"),
    dict(axes=PP_DP, schedule="zb-h2", n_layer=2, m=3, zero=3, accum=2),
    dict(axes=PP_DP, schedule="interleaved", chunks=2, n_layer=4, m=2, zero=3, opt="adamw"),
    dict(axes=PP_DP, schedule="zb-h1", n_layer=2, m=2, zero=3, ckpt=True),  # W differentiates whole stages
    dict(axes=PP_DP, schedule="1f1b", n_layer=2, m=2, zero=3, ckpt="selective", tie=False),
    # accumulation under no_sync: one reduction per optimizer step (ZeRO-1 and ZeRO-3)
    dict(axes=PP_DP, schedule="1f1b", n_layer=2, m=3, zero=1, accum=2, no_sync=True, opt="adamw"),
    dict(axes=PP_DP, schedule="zb-h1", n_layer=2, m=3, zero=3, accum=2, no_sync=True),
]


# tensor parallelism inside the stages: each tp coordinate's units sharded over dp
CASES_8 = [dict(axes=dict(pp=2, dp=2, tp=2), schedule="1f1b", n_layer=2, m=2, zero=3, opt="adamw")]


@pytest.mark.parametrize("n", [4, 8])
def test_zero23_in_pipelines_match_one_device(worlds, n):
    cases = CASES if n == 4 else CASES_8
    per_rank = worlds.get(n).run(hc.check_hybrids, cases, timeout=600)
    for k, case in enumerate(cases):
        for rank, results in enumerate(per_rank):
            res = results[k]
            assert res["loss_err"] < RTOL, (case, rank, res)
            assert res["param_err"] < RTOL, (case, rank, res)
            assert res["keys_ok"], case
            if "clip" in case:
                assert all(r > case["clip"] for r in res["ref_norms"]), res["ref_norms"]
                assert all(abs(a - b) <= 1e-5 * b for a, b in zip(res["norms"], res["ref_norms"])), res
            _check_pattern(case, res)


def _check_pattern(case: dict, res: dict) -> None:
    """Once per pipe.step, one reduce-scatter per group; nothing but shards between the passes and the step."""
    k = case.get("accum", 1)
    for counts in res["step_counts"]:
        reductions = 1 if case.get("no_sync") else k
        assert counts["reduce_scatter"] == reductions * res["n_groups"], (case, counts, res["n_groups"])
        assert counts["all_reduce"] == k, counts  # the losses only
    for held in res["held"]:  # ZeRO-2/3: full gradient buffers freed after the reduction (ZeRO-1 keeps them)
        assert held["full_grads"] == (res["group_numel"] if case["zero"] == 1 else 0), (case, held)
        assert held["handles"] == 0, (case, held)
        assert held["shards_in_buffer"] == (case["zero"] == 1), (case, held)
    if case.get("eval"):  # ZeRO-3's forward-only pass gathers and frees as training does
        assert res["eval_err"] < RTOL, res["eval_err"]
    # AdamW state for this rank's shard only
    assert case.get("opt") != "adamw" or res["state_numel"] == res["shard_numel"], res
    if case["zero"] == 1:
        assert all(n == res["n_groups"] for n in res["opt_all_gathers"]), res
        return
    if case["zero"] == 2:
        assert all(n == res["n_groups"] for n in res["opt_all_gathers"]), res  # the step gathers parameters
        assert all(h["param_numel"] == res["group_numel"] for h in res["held"]), res
    else:
        assert all(n == 0 for n in res["opt_all_gathers"]), res  # units are gathered as they next run
        assert all(h["param_numel"] == 0 for h in res["held"]), res  # between steps: every unit freed
        assert res["n_groups"] >= 2, res  # one group per unit owning parameters (plus the held one)
        # per pass, each unit is gathered in forward and again in backward for every micro-batch
        per_pass = [c["all_gather"] for c in res["step_counts"]]
        assert all(n >= 2 * case["m"] * k for n in per_pass), (case, per_pass)


@pytest.mark.parametrize("zero", [1, 3])
def test_mixed_precision_in_pipelines(worlds, zero):
    """bf16 compute parameters, fp32 masters and fp32 reduction: within bf16 noise of fp32 on one device; the full
    state dict is the fp32 masters; every gradient element reduced once per step, in 4 bytes."""
    for res in worlds.get(4).run(hc.check_mixed_precision, zero, timeout=300):
        assert res["loss_err"] < 2e-2 and res["param_err"] < 2e-2, res
        assert res["compute_dtypes"] == ["torch.bfloat16"] and res["master_dtypes"] == ["torch.float32"], res
        assert res["full_dtypes"] == ["torch.float32"], res
        assert all(b == 4 * res["group_numel"] for b in res["reduced"]), res
        assert res["param_dtypes"] == ["torch.bfloat16"], res


def test_mixed_precision_in_pipelines_bad_input():
    import torch

    from shardwise.parallel.common.mixed_precision import MixedPrecision
    from shardwise.parallel.pipeline.mixed import check_mixed_precision

    cases = [((MixedPrecision(param_dtype=torch.float16), 1, 2, None), "needs loss scaling"),
             ((MixedPrecision(), 0, 2, None), "pass dp_axis (size >= 2) and zero_stage 1, 2 or 3"),
             ((MixedPrecision(), 1, 1, None), "over a dp axis of size 1"),
             ((MixedPrecision(), 1, 2, torch.bfloat16), "pass one of them")]
    for args, needle in cases:
        with pytest.raises(ValueError, match=None) as err:
            check_mixed_precision(*args)
        assert needle in str(err.value) and "\n" not in str(err.value), err.value
    with pytest.raises(TypeError, match="must be a shardwise.MixedPrecision"):
        check_mixed_precision(torch.bfloat16, 1, 2, None)


def test_zero3_refuses_graph_pipelines_before_any_work():
    from types import SimpleNamespace

    from shardwise.parallel.pipeline.validate import check_hybrid

    with pytest.raises(ValueError) as err:  # pure: only the mesh's axis names are read
        check_hybrid(SimpleNamespace(axes=("pp", "dp")), "pp", "dp", 3, False, 25, graph=True)
    assert "captured from example_inputs" in str(err.value) and "use zero_stage 1 or 2" in str(err.value)


def test_optimizer_refuses_unreduced_no_sync_gradients(worlds):
    for message in worlds.get(4).run(hc.check_no_sync_guard, timeout=120):
        assert "never reduced" in message, message
