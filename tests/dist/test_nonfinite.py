"""The trainer's non-finite guard on 2 spawned ranks, in every layout: a NaN loss on rank 1 only makes *every*
rank skip (``train.nonfinite = skip``: model and optimizer state bitwise unchanged, counted, later steps finite)
or raise ``NonFiniteError`` naming the step (``stop``) — the ranks agree through one ``max`` all-reduce per axis,
including ZeRO-1, where rank 0's own (unreduced) gradients are finite.

Rank-side code: tests/dist/nonfinite_checks.py.
"""

from __future__ import annotations

import math

from tests.dist import nonfinite_checks as nc

LAYOUTS = list(nc.LAYOUTS)


def test_skip_agrees_across_ranks_in_every_layout(worlds):
    per_rank = worlds.get(2).run(nc.check_skip, LAYOUTS, timeout=300)
    k = nc.K - 1  # index of the poisoned step
    for i, layout in enumerate(LAYOUTS):
        for rank, results in enumerate(per_rank):
            res = results[i]
            assert res["layout"] == layout
            assert res["skipped"] == [s == k for s in range(nc.K + 1)], (layout, rank, res)
            assert res["same"] == [s == k for s in range(nc.K + 1)], (layout, rank, res)  # only the skip left it
            assert res["count"] == 1
            assert all(math.isfinite(v) for s, v in enumerate(res["losses"]) if s != k), (layout, res["losses"])


def test_stop_raises_on_every_rank_before_the_optimizer(worlds):
    layouts = ["zero1", "tp2", "pp2"]
    per_rank = worlds.get(2).run(nc.check_stop, layouts, timeout=300)
    for i, layout in enumerate(layouts):
        for rank, results in enumerate(per_rank):
            res = results[i]
            assert res["error"] is not None, (layout, rank)
            assert f"at step {nc.K}:" in res["error"] and "--resume" in res["error"], res["error"]
            assert res["same"], (layout, rank)
        if layout == "zero1":  # rank 1's local gradients were not finite; ZeRO-1 reduces during backward, so
            # rank 0's averaged shard (its slice of the gradient buffer) is not either (named by flat offset)
            for r in (0, 1):
                assert "first non-finite gradient on this rank: " in per_rank[r][i]["error"], per_rank[r][i]["error"]
