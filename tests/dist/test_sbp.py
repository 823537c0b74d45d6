"""Exhaustive boxing on 1-D meshes of 1–4 ranks and a 2×2 mesh: values, gradients, collectives, errors."""

from __future__ import annotations

import pytest

from tests.dist import sbp_checks as sc


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_pair_on_a_1d_mesh(worlds, n):
    assert worlds.get(n).run(sc.check_all_pairs, {"dp": -1}, True, timeout=240) == [[]] * n


def test_every_pair_on_a_2x2_mesh(worlds):
    assert worlds.get(4).run(sc.check_all_pairs, {"dp": 2, "tp": 2}, False, timeout=400) == [[]] * 4


@pytest.mark.parametrize("src,dst,want", [
    ("S(0)", "B", {"all_gather": 1}),
    ("P", "B", {"all_reduce": 1}),
    ("P", "S(1)", {"reduce_scatter": 1}),
    ("S(0)", "S(1)", {"all_to_all": 1}),
    ("B", "S(0)", {}),
    ("B", "P", {}),
    ("S(1)", "P", {}),
])
def test_each_conversion_is_one_collective(worlds, src, dst, want):
    assert worlds.get(3).run(sc.count_pattern, src, dst) == [want] * 3


@pytest.mark.parametrize("case,words", [
    ("dim", ["Split dim 2", "2-d"]),
    ("length", ["2 placements", "1 axes"]),
    ("local_shape", ["does not fit", "shape="]),
    ("parse", ["'X'", "S(dim)"]),
])
def test_bad_input(worlds, case, words):
    for msg in worlds.get(2).run(sc.bad_input, case):
        for w in words:
            assert w in msg, (w, msg)
