"""MeshLayout arithmetic without processes."""

from __future__ import annotations

import pytest

from shardwise.mesh import MeshLayout
from shardwise.comm import shard_sizes, shard_offsets


def test_innermost_axis_is_on_consecutive_ranks():
    lay = MeshLayout.infer({"dp": 2, "tp": 2}, 4)
    assert lay.group_ranks("tp") == [[0, 1], [2, 3]]
    assert lay.group_ranks("dp") == [[0, 2], [1, 3]]
    assert [lay.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_three_axes_row_major():
    lay = MeshLayout.infer({"pp": 2, "dp": 3, "tp": 2}, 12)
    assert lay.strides == (6, 2, 1)
    for r in range(12):
        assert lay.rank_of(lay.coords(r)) == r
    assert lay.coords(7) == (1, 0, 1)
    assert lay.axis_ranks(7, "dp") == [7, 9, 11]
    assert lay.axis_ranks(7, "pp") == [1, 7]
    assert sorted(r for g in lay.group_ranks("tp") for r in g) == list(range(12))


def test_minus_one_is_inferred():
    assert MeshLayout.infer({"dp": -1, "tp": 2}, 8).shape == (4, 2)
    assert MeshLayout.infer({"dp": -1}, 3).shape == (3,)


@pytest.mark.parametrize("axes,world,words", [
    ({"dp": 2, "tp": 2}, 6, ["multiply to 4", "world size is 6"]),
    ({"dp": -1, "tp": 4}, 6, ["not divisible", "6"]),
    ({"dp": -1, "tp": -1}, 4, ["only one", "-1"]),
    ({"dp": 0}, 4, ["positive"]),
    ({}, 4, ["at least one axis"]),
])
def test_bad_shapes_say_what_and_how_to_fix(axes, world, words):
    with pytest.raises(ValueError) as info:
        MeshLayout.infer(axes, world)
    for w in words:
        assert w in str(info.value)


def test_unknown_axis_names_the_axes():
    lay = MeshLayout.infer({"dp": 2}, 2)
    with pytest.raises(ValueError, match=r"unknown mesh axis 'tp'.*\['dp'\]"):
        lay.index("tp")


def test_uneven_split_rule():
    assert shard_sizes(10, 4) == [3, 3, 2, 2]
    assert shard_sizes(1, 3) == [1, 0, 0]
    assert shard_sizes(0, 2) == [0, 0]
    assert shard_offsets(10, 4) == [0, 3, 6, 8, 10]
    for length in range(20):
        for parts in range(1, 6):
            sizes = shard_sizes(length, parts)
            assert sum(sizes) == length and max(sizes) - min(sizes) <= 1
            assert sizes == sorted(sizes, reverse=True)
