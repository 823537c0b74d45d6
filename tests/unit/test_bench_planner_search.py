"""``benchmarks/planner_search_measured.py`` without processes: the verdict on synthetic numbers (the 5 % and
top-3 criteria), the tables, the measured set's slices, and the plan → ``shardwise train`` flags mapping, which
must come back as the same plan through ``plan_from_config(cfg, train_passes=True)``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from benchmarks.planner.search import CASES, DEVICES, slices, train_flags
from benchmarks.planner.search_report import model_lines, summary_lines, verdict
from shardwise.planner import Hardware, ModelSpec, Layout
from shardwise.planner.search import search
from shardwise.runtime.config import load_config, parse_overrides, validate
from shardwise.runtime.planning import config_from_plan
from shardwise.runtime.prediction import plan_from_config


def _row(describe: str, rank: int, measured: float | None, predicted: float = 1.0) -> dict[str, Any]:
    return {"describe": describe, "rank": rank, "measured_s": measured, "predicted_s": predicted,
            "predicted_mem": 1e6, "measured_mem": 1e6 if measured else None, "slices": ["top 3"]}


def test_verdict_first_is_best() -> None:
    v = verdict([_row("a", 1, 1.00), _row("b", 2, 1.10), _row("c", 7, 1.30)])
    assert (v["first"], v["best"], v["best_rank"], v["gap"]) == ("a", "a", 1, 0.0)
    assert v["within"] and v["best_in_top"]


def test_verdict_five_percent_boundary_and_top_three() -> None:
    # first 1.05 vs best 1.00: exactly 5 % passes; best at rank 3 is in the top 3
    v = verdict([_row("a", 1, 1.05), _row("b", 3, 1.00)])
    assert v["gap"] == pytest.approx(0.05) and v["within"] and v["best_in_top"]
    # 5.1 % fails; best at rank 4 is not in the top 3
    v = verdict([_row("a", 1, 1.051), _row("b", 4, 1.00), _row("c", 2, 1.2)])
    assert v["gap"] == pytest.approx(0.051) and not v["within"] and not v["best_in_top"] and v["best_rank"] == 4


def test_verdict_gap_is_relative_to_the_best() -> None:
    # |first - best| / best, not / first: 1.2 vs 1.0 is 20 %, not 16.7 %
    assert verdict([_row("a", 1, 1.2), _row("b", 2, 1.0)])["gap"] == pytest.approx(0.2)


def test_tau() -> None:
    v = verdict([_row("a", 1, 1.0, 1.0), _row("b", 2, 2.0, 2.0), _row("c", 3, 3.0, 3.0)])
    assert v["tau"] == 1.0
    v = verdict([_row("a", 1, 3.0, 1.0), _row("b", 2, 2.0, 2.0), _row("c", 3, 1.0, 3.0)])
    assert v["tau"] == -1.0


def test_verdict_failed_runs() -> None:
    v = verdict([_row("a", 1, None), _row("b", 2, 1.0)])  # the first choice's run failed: nothing shows it is good
    assert v["first"] == "a" and v["first_s"] is None and not v["within"] and v["best"] == "b" and v["measured"] == 1
    with pytest.raises(ValueError, match="no plan was measured"):
        verdict([_row("a", 1, None)])


def test_tables_say_when_a_criterion_fails() -> None:
    rows = [_row("a", 1, 1.2), _row("b", 5, 1.0), _row("c", 2, None) | {"status": "failed: boom"}]
    model = {"name": "m", "description": "d", "memory_bytes": 1e8, "memory_source": "lowered", "budget_bytes": 9e7,
             "devices": 4, "plain_dp_bytes": 1.2e8, "plain_dp_fits": False, "feasible": 3, "candidates": 9,
             "space": "s", "rows": rows, "not_runnable": [{"describe": "x", "rank": 4, "reason": "refused"}],
             "verdict": verdict(rows)}
    text = "\n".join(model_lines(model) + summary_lines([model]))
    assert "within 5 %: **NO**" in text and "best in the top 3: **NO**" in text and "**does not fit**" in text
    assert "| 2 | c | 1000 | — | failed: boom |" in text and "- x (planner rank 4): refused" in text
    assert "| m | 90.0 | no | 2 | a | 1200 | b | 1000 | 5 | +20.0% | NO | NO | 0.00 |" in text


def _gpt_case() -> tuple[Any, ModelSpec, Hardware]:
    case = CASES[0]
    cfg = load_config(preset="gpt-small", overrides={**case.model, "data.global_batch": case.global_batch})
    return case, ModelSpec.gpt(cfg.model), Hardware.preset("a100-80g-sxm")


def test_train_flags_round_trip_through_plan_from_config() -> None:
    case, spec, hw = _gpt_case()
    plans = [p.plan for p in search(spec, hw, devices=DEVICES, global_batch=case.global_batch, top=10**6)]
    kinds = {(p.tp > 1, p.pp > 1, p.zero_stage, p.schedule, p.activation_checkpointing) for p in plans}
    picked = [next(p for p in plans if (p.tp > 1, p.pp > 1, p.zero_stage, p.schedule, p.activation_checkpointing)
                   == k) for k in sorted(kinds)]
    assert len(picked) >= 10 and any(p.pp_split for p in picked) and any(p.chunks > 1 for p in picked)
    model = [w for k, v in case.model.items() for w in (f"--{k}", str(v))]
    for plan in picked:
        tokens = [*model, "--data.global_batch", str(case.global_batch), "--parallel.nproc", str(DEVICES),
                  *train_flags(config_from_plan(plan))]
        cfg = validate(load_config(preset="gpt-small", overrides=parse_overrides(tokens)))
        back = plan_from_config(cfg, train_passes=True).resolved(case.global_batch)
        assert back == plan.resolved(case.global_batch), plan.describe()


def test_train_flags_spelling() -> None:
    flags = train_flags({"dp": 2, "pp": 2, "activation_checkpointing": True, "pp_split": ("blocks.3",),
                         "pp_schedule": "zb-h1"})
    assert flags == ["--parallel.dp", "2", "--parallel.pp", "2", "--parallel.activation_checkpointing", "true",
                     "--parallel.pp_split", "blocks.3", "--parallel.pp_schedule", "zb-h1"]
    assert "--parallel.pp_split" not in train_flags({"pp_split": ()})  # no split: train balances by parameters


def test_slices_cover_the_required_dimensions() -> None:
    case, spec, hw = _gpt_case()
    hw = dataclasses.replace(hw, memory_bytes=10e9)
    first = Layout(dp=4, micro_batch=1)
    found = [p.plan for sl in slices(first) for p in search(spec, hw, devices=DEVICES, global_batch=case.global_batch,
                                                            pins=sl.pins, space=sl.space, top=10**6)]
    assert {p.micro_batch for p in found} == {1}
    assert {p.schedule for p in found if p.pp > 1} == {"1f1b", "zb-h1"}
    assert {p.zero_stage for p in found} == {0, 1, 2, 3} and {p.tp for p in found} == {1, 2, 4}
    assert {p.activation_checkpointing for p in found} == {"none", "full"} and {p.pp for p in found} == {1, 2, 4}
