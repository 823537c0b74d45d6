"""SBP placements and the boxing search (router), without processes."""

from __future__ import annotations

import itertools

import pytest
import torch

from shardwise.sbp import Replicate, Partial, Split, parse_sbp, route_boxing
from shardwise.sbp.boxing import bytes_model
from shardwise.sbp.placement import normalize_sbp
from shardwise.sbp.spec import local_shape


def test_placement_forms():
    assert repr(Split(0)) == "Split(dim=0)" and str(Split(0)) == "S(0)"
    assert str(Replicate()) == "B" and str(Partial()) == "P" and str(Partial("max")) == "P(max)"
    assert parse_sbp("S(0), B ,P,P(max)") == (Split(0), Replicate(), Partial("sum"), Partial("max"))
    with pytest.raises(ValueError, match="Partial op"):
        Partial("mean")


def test_normalize_makes_dims_positive_and_rejects_mixed_partials():
    assert normalize_sbp("S(-1)", 3, 1) == (Split(2),)
    with pytest.raises(ValueError, match="mixes"):
        normalize_sbp("P,P(max)", 2, 2)


def test_nested_splits_follow_axis_order():
    # dim 0 of 9 rows split by dp=2 ([5, 4]) then each piece by tp=2: [3, 2] and [2, 2].
    shapes = {c: local_shape((9, 4), (Split(0), Split(0)), (2, 2), c) for c in itertools.product(range(2), repeat=2)}
    assert shapes == {(0, 0): (3, 4), (0, 1): (2, 4), (1, 0): (2, 4), (1, 1): (2, 4)}


@pytest.mark.parametrize("src,dst,collectives", [
    ("S(0)", "B", ["all_gather"]), ("P", "B", ["all_reduce"]), ("P", "S(0)", ["reduce_scatter"]),
    ("S(0)", "S(1)", ["all_to_all"]), ("B", "S(1)", ["slice"]), ("B", "P", ["keep_one"]),
    ("S(0)", "P", ["zero_pad"]), ("P", "P(max)", ["all_reduce", "identity"]), ("B", "B", []),
])
def test_one_axis_plans(src, dst, collectives):
    plan = route_boxing((8, 6), 4, parse_sbp(src), parse_sbp(dst), (4,), ("tp",))
    assert [s.collective for s in plan.steps] == collectives


def test_plan_prints_as_steps():
    plan = route_boxing((8, 6), 4, parse_sbp("P"), parse_sbp("S(0)"), (2,), ("tp",))
    assert str(plan) == "[P] -> [S(0)]\n  P -> S(0): reduce_scatter(axis=tp)"


def test_2d_plan_reduce_scatters_before_reducing_the_other_axis():
    # (P, P) -> (B, B): two all-reduces move 2·(2·½)·M = 2M; RS(dp), AR(tp) on M/2, AG(dp) moves 1.5M.
    plan = route_boxing((8, 8), 4, parse_sbp("P,P"), parse_sbp("B,B"), (2, 2), ("dp", "tp"))
    M = 8 * 8 * 4
    assert plan.bytes_sent == int(1.5 * M)
    assert plan.bytes_sent < 2 * bytes_model("all_reduce", 2, M)


def test_plans_respect_nesting():
    # dp's split of dim 0 cannot be gathered while tp still splits dim 0 inside it.
    plan = route_boxing((8, 8), 4, parse_sbp("S(0),S(0)"), parse_sbp("B,S(0)"), (2, 2), ("dp", "tp"))
    state = list(parse_sbp("S(0),S(0)"))
    for step in plan.steps:
        for p in (step.src, step.dst):
            if isinstance(p, Split):
                assert p not in state[step.axis_index + 1:], str(plan)
        state[step.axis_index] = step.dst
    assert tuple(state) == parse_sbp("B,S(0)")


def test_every_2x2_pair_has_a_plan_and_plans_are_cached():
    places = [Split(0), Split(1), Replicate(), Partial()]
    for src, dst in itertools.product(itertools.product(places, repeat=2), repeat=2):
        plan = route_boxing((5, 7), 4, src, dst, (2, 2), ("dp", "tp"))
        assert plan.dst == dst
    a = route_boxing((5, 7), 4, (Partial(), Partial()), (Replicate(), Replicate()), (2, 2), ("dp", "tp"))
    assert a is route_boxing((5, 7), 4, (Partial(), Partial()), (Replicate(), Replicate()), (2, 2), ("dp", "tp"))


def test_custom_cost_model_changes_the_choice():
    # With a huge per-collective latency, the single-step plans win over bandwidth-saving three-step ones.
    latency_bound = lambda coll, n, nbytes: 0.0 if coll in ("slice", "keep_one", "identity", "zero_pad") else 1e9
    plan = route_boxing((8, 8), 4, parse_sbp("P,P"), parse_sbp("B,B"), (2, 2), ("dp", "tp"), latency_bound)
    assert [s.collective for s in plan.steps] == ["all_reduce", "all_reduce"]


def test_calibrated_cost_prefers_fewer_collectives_when_latency_dominates():
    from shardwise.comm.calibration import AlphaBeta, Calibration
    from shardwise.sbp.boxing import calibrated_cost

    slow_start = {op: {"native": AlphaBeta(1e6, 1e-9)} for op in ("all_reduce", "all_gather", "reduce_scatter")}
    cal = Calibration(world_size=2, backend="gloo", device="cpu", models=slow_start)
    plan = route_boxing((8, 8), 4, parse_sbp("P,P"), parse_sbp("B,B"), (2, 2), ("dp", "tp"), calibrated_cost(cal))
    assert [s.collective for s in plan.steps] == ["all_reduce", "all_reduce"]
    # Bandwidth-bound, with ring-like per-byte costs on 2 ranks: all-reduce moves 2(n-1)/n, the others (n-1)/n.
    fast_start = {"all_reduce": {"native": AlphaBeta(0.0, 1.0)}, "all_gather": {"native": AlphaBeta(0.0, 0.5)},
                  "reduce_scatter": {"native": AlphaBeta(0.0, 0.5)}}
    cal = Calibration(world_size=2, backend="gloo", device="cpu", models=fast_start)
    plan = route_boxing((8, 8), 4, parse_sbp("P,P"), parse_sbp("B,B"), (2, 2), ("dp", "tp"), calibrated_cost(cal))
    assert len(plan.steps) == 3  # reduce-scatter, all-reduce on half, all-gather
