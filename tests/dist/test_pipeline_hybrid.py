"""Pipeline hybrids against one-device training of the same GPT (fp32, rtol 1e-5): pp x dp with the dp
reduction bucketed and started inside the last backward, ZeRO-1 over dp, tensor parallelism inside the
stages (pp x tp, pp x dp x tp), activation checkpointing per stage. Rank side:
tests/dist/pipeline_hybrid_checks.py. Besides values, the dp communication pattern is asserted per step.
"""

from __future__ import annotations

import pytest

from tests.dist import pipeline_hybrid_checks as hc

RTOL = 1e-5
TINY = 1e-9  # MB: every parameter its own gradient bucket

CASES = {
    4: [
        dict(axes=dict(pp=2, dp=2), schedule="1f1b", n_layer=2, m=3, cap_mb=TINY, clip=0.5),
        dict(axes=dict(pp=2, dp=2), schedule="zb-h1", n_layer=2, m=2, cap_mb=TINY),
        dict(axes=dict(pp=2, dp=2), schedule="1f1b", n_layer=2, m=2, zero=1, opt="adamw"),
        dict(axes=dict(pp=2, dp=2), schedule="zb-h1", n_layer=2, m=3, zero=1, accum=2),  # ZeRO-1 accumulates
        dict(axes=dict(pp=2, dp=2), schedule="zb-h1", n_layer=3, m=3, zero=1, opt="adamw", cap_mb=TINY, clip=0.5),
        dict(axes=dict(pp=2, dp=2), schedule="1f1b", n_layer=2, m=2, ckpt=True),
        dict(axes=dict(pp=2, dp=2), schedule="zb-h1", n_layer=2, m=3, ckpt=True, opt="adamw"),
        dict(axes=dict(pp=2, tp=2), schedule="1f1b", n_layer=2, m=3, clip=0.5),
        dict(axes=dict(pp=2, tp=2), schedule="zb-h1", n_layer=2, m=2, ckpt=True),
        dict(axes=dict(pp=2, tp=2), schedule="1f1b", n_layer=2, m=2, sp=True, tie=False),
        # split backward with sequence parallelism: W of the replicated norms/biases/wpe sums over tp
        dict(axes=dict(pp=2, tp=2), schedule="zb-h1", n_layer=2, m=2, sp=True, tie=False, clip=0.5),
        # shardwise train's pp 2 × tp 2 with ZeRO-1 on 4 ranks: mesh (pp, dp, tp) = (2, 1, 2), dp_axis "dp" of size 1;
        # clipped with SGD for the reason given for the 8-rank cases (with AdamW, 1.25e-5 on some CPUs)
        dict(axes=dict(pp=2, dp=1, tp=2), schedule="1f1b", n_layer=2, m=2, zero=1, clip=0.5),
        dict(axes=dict(pp=2, dp=1, tp=2), schedule="1f1b", n_layer=2, m=2, zero=1, opt="adamw"),
    ],
    8: [
        # (clipping is checked with SGD here: AdamW divides by sqrt(v) + eps, and on clipped, smaller gradients
        # that amplifies float summation-order noise to ~1.5e-5 relative, past the tolerance)
        dict(axes=dict(pp=2, dp=2, tp=2), schedule="1f1b", n_layer=2, m=2, zero=1, opt="adamw"),
        dict(axes=dict(pp=2, dp=2, tp=2), schedule="zb-h1", n_layer=2, m=2, clip=0.5),
        dict(axes=dict(pp=2, dp=2, tp=2), schedule="1f1b", n_layer=2, m=2, zero=1, clip=0.5, tie=False),
    ],
}


@pytest.mark.parametrize("n", [4, 8])
def test_hybrids_match_one_device(worlds, n):
    cases = CASES[n]
    per_rank = worlds.get(n).run(hc.check_hybrids, cases, timeout=300)
    for k, case in enumerate(cases):
        for rank, results in enumerate(per_rank):
            res = results[k]
            if "clip" in case:  # pipe.clip_grad_norm_: the one-device norm, and clipping really happened
                assert all(r > case["clip"] for r in res["ref_norms"]), res["ref_norms"]
                assert all(abs(a - b) <= 1e-5 * b for a, b in zip(res["norms"], res["ref_norms"])), res
            assert res["loss_err"] < RTOL, (case, rank, res)
            assert res["param_err"] < RTOL, (case, rank, res)
            assert res["keys_ok"], case
            _check_dp_pattern(case, res)


def _check_dp_pattern(case: dict, res: dict) -> None:
    """Per step: one loss all-reduce over dp, plus one gradient collective per bucket (all-reduce, or
    reduce-scatter with ZeRO-1) carrying this rank's stage gradients exactly once; ZeRO-1's step all-gathers
    once per bucket and keeps optimizer state for 1/dp of the parameters."""
    if case["axes"].get("dp", 1) == 1:  # no dp replicas (dp = 1: ZeRO-1 has nothing to shard, a plain optimizer)
        assert all(c["all_reduce"] == 0 and c["reduce_scatter"] == 0 for c in res["step_counts"]), res
        return
    tiny = case.get("cap_mb") == TINY
    k = case.get("accum", 1)  # pipe.step calls per optimizer step: the pattern repeats k times
    for counts in res["step_counts"]:
        grads = counts["reduce_scatter"] if case.get("zero") else counts["all_reduce"] - k
        if tiny:  # one bucket per parameter
            assert grads == k * res["n_params"], (case, counts, res["n_params"])
        else:  # default 25 MB: one bucket of the stage's own parameters, one more for the tied one
            assert grads == k * (1 + (res["n_tied"] > 0)), (case, counts)
        moved = counts["rs_bytes"] if case.get("zero") else counts["ar_bytes"] - 4 * k  # minus the fp32 losses
        assert moved == k * res["local_bytes"], (case, counts, res["local_bytes"])
    if case.get("zero"):
        assert all(c["all_reduce"] == k for c in res["step_counts"]), res  # the losses only
        # on CPU with sw.zero's collective, our ring (gloo's own reduce-scatter is 2-3x slower); the step's
        # all-gathers (opt_all_gathers counts ring ones) likewise
        assert all(c["rs_ring"] == c["reduce_scatter"] for c in res["step_counts"]), res
        assert all(n == (res["n_params"] if tiny else 1 + (res["n_tied"] > 0)) for n in res["opt_all_gathers"])
        # AdamW state exists for this rank's shard: 1/dp of the elements, up to one element per bucket
        buckets = res["n_params"] if tiny else 2
        assert case.get("opt") != "adamw" or abs(res["state_numel"] - res["local_numel"] / res["dp"]) <= buckets, res
    if case["schedule"] == "1f1b" and tiny:
        # every untied parameter's bucket started from its gradient hook inside the last backward
        assert all(b == res["n_params"] - res["n_tied"] for b in res["in_backward"]), res
    if case["schedule"] == "zb-h1":
        assert all(b == 0 for b in res["in_backward"]), res  # W writes .grad directly: started when W ends


def test_stage_checkpointing_keeps_less(worlds):
    for res in worlds.get(2).run(hc.check_stage_checkpointing):
        assert 0 < res["on"] < res["off"], res


BAD = {
    "zero_without_dp": "dp_axis is None",
    "zero_stage_4": "zero_stage must be 0, 1, 2 or 3",
    "checkpoint_not_bool": "checkpoint must be True or False (recompute each unit's activations in backward), or "
                           "'none', 'full' or 'selective'",
    "bucket_cap_zero": "bucket_cap_mb must be a number > 0",
}


def test_hybrid_bad_input_raises_before_communication(worlds):
    for messages in worlds.get(4).run(hc.check_hybrid_bad_input, list(BAD)):
        for name, needle in BAD.items():
            assert needle in messages[name], (name, messages[name])
