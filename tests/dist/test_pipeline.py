"""sw.pipeline on worlds of 2 and 4 ranks against one-device SGD training of the same GPT (fp32, rtol 1e-5).

Rank-side code: tests/dist/pipeline_checks.py. Each world runs all its cases in one ``world.run``. Besides
losses and parameters (via ``sw.full_state_dict``), every case checks the point-to-point pattern per step:
each stage boundary carries one forward and one backward message per micro-batch, plus one dtype/shape
message per boundary on the first step only, plus one message each way for a tied embedding/head.
"""

from __future__ import annotations

import pytest
import torch

from shardwise.parallel.pipeline.stage import balance_by_params
from tests.dist import pipeline_checks as pc

RTOL = 1e-5

CASES = {
    2: [
        dict(schedule="gpipe", n_layer=2, m=3),
        dict(schedule="1f1b", n_layer=2, m=3),
        dict(schedule="zb-h1", n_layer=2, m=3),
        dict(schedule="1f1b", n_layer=3, m=4, split=["blocks.1"]),  # uneven: embed+b0 | b1, b2, head
        dict(schedule="zb-h1", n_layer=3, m=2, split=["ln_f"]),  # the head alone on the last stage
        dict(schedule="gpipe", n_layer=2, m=2, tie=False),
        dict(schedule="interleaved", n_layer=4, m=4, chunks=2),
        dict(schedule="zb-h1", n_layer=2, m=3, accum=2),  # two steps per optimizer step: tied grads add up
        dict(schedule="1f1b", model="mlp", n_layer=0, m=4, tie=False),  # an nn.Sequential
        # one Linear used twice: both uses on stage 0 (zb-h1's W falls back to the whole stage), or one use
        # per stage (a weight shared across ranks, kept tied like the GPT's embedding and head)
        dict(schedule="zb-h1", model="mlp-shared", n_layer=0, m=3, tie=False, split=["5"]),
        dict(schedule="zb-h1", model="mlp-shared", n_layer=0, m=3, tie=2, split=["3"]),  # weight and bias
        dict(schedule="zb-h2", n_layer=2, m=3),
        # m = 1: rank 0's gradient receive is placed before its own first forward, whose output fixes that
        # boundary's shape, so the executor defers it (the default placement defers the first step's early
        # receives on every case); and receives placed just before their consumer (the naive placement)
        dict(schedule="1f1b", n_layer=2, m=1),
        dict(schedule="1f1b", n_layer=2, m=4, ahead=0, late=True),
    ],
    4: [
        dict(schedule="gpipe", n_layer=4, m=6),
        dict(schedule="1f1b", n_layer=4, m=6),
        dict(schedule="zb-h1", n_layer=4, m=6),
        dict(schedule="1f1b", n_layer=4, m=4, split=["blocks.0", "blocks.3", "ln_f"]),  # embed | b0-b2 | b3 | head
        dict(schedule="zb-h1", n_layer=4, m=3, split=["blocks.0", "blocks.3", "ln_f"]),  # m < p
        dict(schedule="interleaved", n_layer=6, m=4, chunks=2),
        dict(schedule="zb-h1", model="mlp", n_layer=0, m=6, tie=False, split=["2", "4", "6"]),
        dict(schedule="1f1b", n_layer=2, m=3, dp=2),  # pp x dp = 2 x 2: replicas of a 2-stage pipeline
        dict(schedule="interleaved", n_layer=4, m=2, chunks=2, dp=2),  # per-stage buckets, two stages a rank
        dict(schedule="zb-h1", n_layer=3, m=2, dp=2),
        dict(schedule="zb-h2", n_layer=4, m=12),  # m >= 2p - 1: the full warm-up of 2(p - r) - 1 forwards
        dict(schedule="zb-h2", n_layer=3, m=3, dp=2),
    ],
}


def _expected_sends(case: dict, rank: int, p: int) -> tuple[int, int]:
    """(first step, later steps) sends of ``rank`` from the rules in the module doc."""
    stages = p * case.get("chunks", 1)
    m, later, meta = case["m"], 0, 0
    for s in range(rank, stages, p):
        if s < stages - 1 and (s + 1) % p != rank:
            later, meta = later + m, meta + 1
        if s > 0 and (s - 1) % p != rank:
            later += m
    if rank in (0, p - 1) and p > 1:
        later += int(case.get("tie", True))  # one message per tied parameter (tie=2: a weight and a bias)
    return later + meta, later


@pytest.mark.parametrize("n", [2, 4])
def test_schedules_match_one_device(worlds, n):
    cases = CASES[n]
    per_rank = worlds.get(n).run(pc.check_parity, cases, timeout=240)
    for k, case in enumerate(cases):
        for results in per_rank:
            res = results[k]
            rank, p = res["coord"], res["p"]  # pipeline coordinate and size (a pp x dp mesh has p < n)
            assert res["loss_err"] < RTOL, (case, res)
            assert res["param_err"] < RTOL, (case, res)
            assert res["keys_ok"], case
            first, later = _expected_sends(case, rank, p)
            # pp x dp: per step one loss all-reduce over dp and one gradient all-reduce per bucket (the default
            # 25 MB cap: one per local stage, one more for a tied weight, reduced after the tied exchange); none
            # without dp. tests/dist/test_pipeline_hybrid.py checks buckets and bytes in detail.
            want = 1 + case.get("chunks", 1) + bool(res["tied_peers"]) if "dp" in case else 0
            assert res["dp_reduces"] == [want] * len(res["sends"]), (case, res["dp_reduces"])
            steps = pc.STEPS * case.get("accum", 1)
            assert res["sends"] == [first] + [later] * (steps - 1), (case, rank, res["sends"])
            assert res["state_dict_sends"] == 0, case  # full_state_dict uses broadcasts, no point-to-point
            # a rank keeps only its own stages' tensors, strictly less than the whole model when p > 1
            assert res["kept_numel"] == res["stage_numel"], (case, rank)
            assert p == 1 or res["kept_numel"] < res["model_numel"], (case, rank)
            peak = {"gpipe": case["m"], "1f1b": min(p - rank, case["m"]), "zb-h1": min(p, case["m"]),
                    "zb-h2": min(2 * p - 1, case["m"])}
            if case["schedule"] in peak:  # activation sets held at once: the schedule's memory bound
                assert res["peak_held"] == peak[case["schedule"]], (case, rank, res["peak_held"])
            chunks = case.get("chunks", 1)
            assert res["my_stages"] == [rank + c * p for c in range(chunks)], case
            if case.get("tie", True):
                want = {0: [p - 1], p - 1: [0]}.get(rank, []) * int(case.get("tie", True))
                assert res["tied_peers"] == want, (case, rank)
            else:
                assert res["tied_peers"] == [], case
        by_coord = {r[k]["coord"]: r[k] for r in per_rank}
        p = per_rank[0][k]["p"]
        if case.get("tie", True) and p > 1:  # the two copies of a tied weight stay bit-identical, accumulation too
            for a, b in zip(by_coord[0]["tied_values"], by_coord[p - 1]["tied_values"]):
                assert torch.equal(a, b), (case, (a - b).abs().max())
        stages = per_rank[0][k]["stages"]
        if "split" in case:
            starts = [names[0] for _, names in sorted(stages.items())][1:]
            assert starts == case["split"], stages


def test_balance_by_parameter_count(worlds):
    # GPT(n_layer=4, n_embd=32, vocab 64, block 16) units: embed 2560, block 12,704 each, head 2112 (tied wte
    # counted again) -> pp=2: [embed, b0, b1] | [b2, b3, head] (27,968 vs 27,520) beats any other cut
    res = worlds.get(2).run(pc.check_parity, [dict(schedule="1f1b", n_layer=4, m=2)], timeout=120)
    stages = res[0][0]["stages"]
    assert stages[0] == ["wte", "wpe", "drop", "blocks.0", "blocks.1"], stages
    assert stages[1] == ["blocks.2", "blocks.3", "ln_f", "lm_head"], stages


BAD = {
    "split_unknown": "names no module",
    "split_inner": "inside unit 'ln_f'",
    "split_empty": "leaves a stage empty",
    "split_count": "makes 3 stages but the mesh axis and chunks need pp x chunks = 4",
    "split_order": "in model order",
    "too_few_units": "has 3 pipeline units",
    "interleaved_m": "multiple of p",
    "microbatches_zero": "microbatches must be an integer >= 1",
    "schedule_unknown": "valid schedules: gpipe, 1f1b, interleaved, zb-h1",
    "batch_not_divisible": "divisible by microbatches=4",
    "dp_axis_is_pp": "other than the pipeline axis 'pp'",
    "recv_ahead_negative": "recv_ahead must be an integer >= 0",
}


def test_bad_input_raises_before_communication(worlds):
    per_rank = worlds.get(4).run(pc.check_bad_input, list(BAD))
    for messages in per_rank:
        for name, needle in BAD.items():
            assert needle in messages[name], (name, messages[name])


def test_balance_by_params_minimises_the_heaviest_stage():
    # pure: no processes
    assert balance_by_params([5, 1, 1, 1, 5], 3) == [0, 1, 4]
    assert balance_by_params([1, 1, 1, 1], 4) == [0, 1, 2, 3]
    assert balance_by_params([10, 1, 1, 1, 1, 1, 1], 2) == [0, 1]
    assert balance_by_params([1, 1, 1, 1, 1, 1, 10], 2) == [0, 6]


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_measured_timeline_follows_schedule_and_dependencies(worlds, tmp_path, schedule):
    import json

    from shardwise.parallel.pipeline import get_schedule

    p, m = 4, 6
    path = tmp_path / "trace.json"
    per_rank = worlds.get(p).run(pc.check_timeline, schedule, m, str(path))
    events = per_rank[0]
    assert all(r == events for r in per_rank)  # every rank gets the same gathered timeline
    want = get_schedule(schedule, p=p, m=m)
    for rank in range(p):
        mine = [e for e in events if e[0] == rank]
        assert [e[1] for e in mine] == [str(a) for a in want.ranks[rank]]  # executed in schedule order
        assert all(a[3] <= b[2] for a, b in zip(mine, mine[1:]))  # one action at a time per rank
    at = {e[1]: e for e in events}
    for i in range(m):  # an action starts only after the remote work it consumes has finished (one host clock)
        for s in range(p - 1):
            assert at[f"{s}F{i}"][3] <= at[f"{s + 1}F{i}"][2]
            assert at[f"{s + 1}B{i}"][3] <= at[f"{s}B{i}"][2]
    trace = json.loads(path.read_text())["traceEvents"]
    assert sorted(e["name"] for e in trace if e["ph"] == "X") == sorted(e[1] for e in events)
