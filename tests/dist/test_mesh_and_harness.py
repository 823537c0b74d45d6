"""Mesh over real ranks, the LocalWorld harness' failure reporting, and the autograd pairs."""

from __future__ import annotations

import pytest

from shardwise.testing.local_world import LocalWorld, RankFailure
from tests.dist import mesh_checks as mc


def test_mesh_2x2_coordinates_groups_and_sub_mesh(worlds):
    facts = worlds.get(4).run(mc.mesh_facts)
    assert [f["coords"] for f in facts] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [f["tp_ranks"] for f in facts] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [f["dp_ranks"] for f in facts] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(f["shape"] == (2, 2) and f["axes"] == ("dp", "tp") for f in facts)
    assert [f["sub_coord"] for f in facts] == [0, 1, 0, 1]
    assert all(f["sub_axes"] == ("tp",) and f["sub_size"] == 2 for f in facts)
    assert facts[0]["device"] == "cpu" and facts[0]["repr"] == "Mesh(dp=2, tp=2)"


def test_a_raising_rank_is_reported_with_its_traceback():
    with LocalWorld(2) as w:
        with pytest.raises(RankFailure) as info:
            w.run(mc.raise_on_rank, 1, timeout=60)
    assert "rank 1 raised" in str(info.value) and "boom from rank 1" in str(info.value)


def test_a_hang_fails_fast_with_every_stuck_rank_stack():
    with LocalWorld(2) as w:
        with pytest.raises(RankFailure) as info:
            w.run(mc.hang_on_rank, 0, timeout=8)
        text = str(info.value)
        assert "timed out" in text and "rank 0 did not finish" in text
        assert "hang_on_rank" in text  # the stuck rank's Python stack names the function
        # The world recovers: the next run starts fresh ranks.
        assert w.run(mc.raise_on_rank, 99) == [0, 0]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_autograd_pairs_match_single_device(worlds, n):
    assert worlds.get(n).run(mc.check_autograd_pairs) == [[]] * n
