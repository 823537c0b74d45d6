"""A small transformer-like program on global tensors equals one device, under many layouts."""

from __future__ import annotations

import pytest

from tests.dist import ops_checks as oc

LAYOUTS_1D = [
    {},                                                      # everything replicated
    {"x": "S(0)"},                                           # data parallel
    {"x": "S(1)"},                                           # sequence split
    {"w1": "S(0)", "b1": "S(0)", "w2": "S(1)"},              # Megatron column -> row
    {"x": "S(2)", "w1": "S(1)"},                             # hidden split: S(-1) x S(1) -> P
    {"head": "S(0)", "x": "S(0)"},                           # vocabulary-split head
    {"x": "P", "ln_w": "S(0)"},                              # partial input, split norm weight
]


@pytest.mark.parametrize("n", [2, 3])
def test_program_matches_single_device_1d(worlds, n):
    w = worlds.get(n)
    for layout in LAYOUTS_1D:
        assert w.run(oc.check_program, {"dp": -1}, layout) == [[]] * n, layout


@pytest.mark.parametrize("layout", [
    {"x": "S(0),B", "w1": "B,S(0)", "b1": "B,S(0)", "w2": "B,S(1)"},   # dp x tp
    {"x": "S(0),S(1)", "head": "B,S(0)"},
    {"x": "P,S(0)", "w2": "S(1),B"},
])
def test_program_matches_single_device_2x2(worlds, layout):
    assert worlds.get(4).run(oc.check_program, {"dp": 2, "tp": 2}, layout) == [[]] * 4


def test_an_op_without_a_rule_names_it_and_suggests_a_fix(worlds):
    for msg in worlds.get(2).run(oc.missing_rule):
        assert "cumsum" in msg and "S(0)" in msg and "to_sbp" in msg and "to_local" in msg


def test_tensors_on_different_meshes_are_rejected(worlds):
    for msg in worlds.get(2).run(oc.different_meshes):
        assert "different meshes" in msg
