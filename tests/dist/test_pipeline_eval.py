"""``Pipeline.evaluate`` (forward only) against one device: the loss of the same model in eval mode under
``no_grad`` on the same batch (rel 1e-6, fp32), before training and after an optimizer step, with the pipeline's
loss and with a ``loss_fn`` override; chain and graph pipelines, 1F1B, interleaved, zero-bubble (split backward)
with activation checkpointing and dropout, pp x dp with ZeRO-1, pp x tp. An evaluation leaves the training
untouched: a run with evaluations between its steps trains to the same bits as one without, gradients and the
last step's events are unchanged, nothing is saved for a backward. Communication of an evaluation: one message
per micro-batch per stage boundary (plus one shape message per boundary the first time), the loss broadcast
along pp and one loss all-reduce over dp; no gradient collective. Rank side: tests/dist/pipeline_eval_checks.py.
"""

from __future__ import annotations

import pytest

from tests.dist import pipeline_eval_checks as ec

TOL = 1e-6
CASES = {
    2: [
        dict(model="gpt", schedule="1f1b", m=2),
        dict(model="gpt", schedule="interleaved", m=2, chunks=2, n_layer=4),
        # split backward and checkpointing in training; dropout: evaluate runs the stages in eval mode
        dict(model="gpt", schedule="zb-h1", m=2, ckpt=True, dropout=0.2),
        # keyword inputs, the model's own loss (labels=), a dataclass output; the override takes targets last
        dict(model="toy", schedule="1f1b", m=2),
    ],
    4: [
        dict(model="gpt", schedule="1f1b", m=2, axes=dict(pp=2, dp=2), zero=1, opt="adamw"),
        dict(model="gpt", schedule="1f1b", m=2, axes=dict(pp=2, tp=2)),
    ],
}


def _sends(case: dict, coord: int, p: int) -> int:
    """Activation messages one evaluation sends from pipeline coordinate ``coord``: m per local stage that
    feeds a stage on another rank (stage s lives on rank s % p)."""
    stages = p * case.get("chunks", 1)
    return sum(case["m"] for s in range(coord, stages - 1, p) if (s + 1) % p != coord)


@pytest.mark.parametrize("n", [2, 4])
def test_evaluate_matches_one_device_and_leaves_training_alone(worlds, n):
    cases = CASES[n]
    per_rank = worlds.get(n).run(ec.check_evaluate, cases, timeout=180)
    for k, case in enumerate(cases):
        total = {"first": 0, "later": 0}
        for results in per_rank:
            res = results[k]
            assert res["e0_err"] < TOL and res["e1_err"] < TOL, (case, res)
            assert res["override_err"] < TOL, (case, res)
            assert abs(res["override_vs_default"] - 1) > 0.5, (case, res)  # the override really ran
            assert res["mid_same"] and res["grads_none"] and res["grads_same"], (case, res)
            assert res["same_training"], (case, res)
            assert res["train_err"] < 1e-5 and res["param_err"] < 1e-5, (case, res)  # the runs train right
            assert res["events_same"] and res["modes_restored"], (case, res)
            assert res["eval_saved"] == 0 < res["step_saved"], (case, res)  # nothing kept for a backward
            coord, p = res["coord"], res["p"]
            boundaries = sum(1 for s in range(coord, p * case.get("chunks", 1) - 1, p) if (s + 1) % p != coord)
            sends = _sends(case, coord, p)
            assert res["later_counts"]["send"] == sends, (case, coord, res["later_counts"])
            assert res["first_counts"]["send"] == sends + boundaries, (case, coord, res["first_counts"])
            total["first"] += res["first_counts"]["send"]
            total["later"] += res["later_counts"]["send"]
            dp = case.get("axes", {}).get("dp", 1)
            for counts in (res["first_counts"], res["later_counts"]):
                assert counts["pp_broadcast"] == 1 and counts["dp_all_reduce"] == (dp > 1), (case, counts)
                assert counts["reduce_scatter"] == 0 and counts["all_gather"] == 0, (case, counts)
        # the whole world: (stages - 1) x m activation messages per pipeline (each dp replica runs its own)
        pipes = n // 2 if "dp" in case.get("axes", {}) else 1
        tp = case.get("axes", {}).get("tp", 1)
        stages = 2 * case.get("chunks", 1)
        assert total["later"] == pipes * tp * (stages - 1) * case["m"], (case, total)


def test_forward_only_schedule_and_its_validation():
    # pure: no processes
    from shardwise.parallel.pipeline import Schedule, lower_communication, parse_actions, simulate
    from shardwise.parallel.pipeline.schedules import forward_only

    s = forward_only(2, 3)
    assert s.to_text() == "rank 0: 0F0 0F1 0F2\nrank 1: 1F0 1F1 1F2"
    assert lower_communication(s, recv_ahead=0, recv_before_send=False).to_text() == (
        "rank 0: 0F0 0SF0 0F1 0SF1 0F2 0SF2\nrank 1: 1RF0 1F0 1RF1 1F1 1RF2 1F2")
    # interleaved order: groups of p micro-batches per chunk; (m·chunks + p − 1) forwards at unit cost
    s = forward_only(2, 4, chunks=2)
    assert s.to_text() == "rank 0: 0F0 0F1 2F0 2F1 0F2 0F3 2F2 2F3\nrank 1: 1F0 1F1 3F0 3F1 1F2 1F3 3F2 3F3"
    assert simulate(s).makespan == 4 * 2 + 2 - 1
    assert simulate(forward_only(4, 5)).makespan == 5 + 4 - 1
    with pytest.raises(ValueError, match="multiple of p"):
        forward_only(2, 3, chunks=2)
    # validation is per kind of schedule: a forward-only one may not list B, a training one must
    ranks = (tuple(parse_actions("0F0 0B0")), tuple(parse_actions("1F0 1B0")))
    with pytest.raises(ValueError, match="duplicated/unexpected: 0B0"):
        Schedule(name="x", p=2, m=1, chunks=1, split_backward=False, ranks=ranks, forward_only=True).validate()
    fwd = (tuple(parse_actions("0F0")), tuple(parse_actions("1F0")))
    with pytest.raises(ValueError, match="missing: 0B0, 1B0"):
        Schedule(name="x", p=2, m=1, chunks=1, split_backward=False, ranks=fwd).validate()
    with pytest.raises(ValueError, match="no backward to split"):
        Schedule(name="x", p=2, m=1, chunks=1, split_backward=True, ranks=fwd, forward_only=True).validate()


BAD = {
    "one_tensor": "takes two tensors",
    "keywords": "keyword inputs need sw.pipeline(..., example_inputs=...)",
    "loss_not_callable": "loss_fn must be callable",
    "rows": "divisible by microbatches=2",
}


def test_evaluate_bad_input_raises_before_communication(worlds):
    for messages in worlds.get(2).run(ec.check_bad_evaluate):
        for name, needle in BAD.items():
            assert needle in messages[name], (name, messages[name])
