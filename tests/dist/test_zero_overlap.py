"""ZeRO stages 1-2 reduce-scatter each gradient bucket during backward (tests/dist/zero_overlap_checks.py).

Per synchronised backward: one reduce-scatter per bucket, of the bucket's bytes (derived by hand from the
parameter sizes and the caps in the checks' docstring), the first three issued before the last layer's
gradient arrives (overlap), all four before ``backward()`` returns; none inside ``no_sync`` and none at the
step (which all-gathers once per bucket). Values: params, losses and clip norms of one process.
"""

from __future__ import annotations

import pytest

from tests.dist import zero_overlap_checks as zo

RTOL = 1e-5
CONFIGS = [(stage, variant, unused) for stage in (1, 2)
           for variant, unused in (("plain", False), ("serial", False), ("native", False), ("shm", False),
                                   ("plain", True),
                                   ("accum", True),
                                   ("accum-sync", True), ("accum-sync", False))]


@pytest.mark.parametrize("n", [2, 4])
def test_overlapped_reduction_matches_one_process(worlds, n):
    per_rank = worlds.get(n).run(zo.check_overlap, CONFIGS, timeout=300)
    for k, cfg in enumerate(CONFIGS):
        stage, variant, unused = cfg
        for ranks in per_rank:
            res = ranks[k]
            assert res["cfg"] == cfg
            assert res["keys_ok"], cfg
            assert res["err"] < RTOL, (cfg, res["err"])
            assert res["loss_err"] < RTOL, (cfg, res["loss_err"])
            assert res["norm_err"] < RTOL, (cfg, res["norm_err"])  # clip_grad_norm_: the global norm
            buckets = zo.BUCKET_BYTES_UNUSED if unused else zo.BUCKET_BYTES
            for ph in res["phases"]:
                if ph["kind"] != "local":  # CPU default: the ring (gloo's own reduce-scatter is slower)
                    assert ph["algorithms"] == [variant if variant in ("native", "shm") else "ring"], (cfg, ph)
                if ph["kind"] == "step":
                    assert "reduce_scatter" not in ph["ops"], (cfg, ph)
                    assert ph["ops"].get("all_gather") == len(buckets), (cfg, ph)
                    continue
                if ph["kind"] == "local":
                    assert ph["backward"] == [], (cfg, ph)  # no_sync: nothing reduced
                    continue
                assert ph["backward"] == buckets, (cfg, ph)  # one per bucket, in order, before backward returns
                # overlap: the buckets complete before l0's gradient exists are on their way already (with
                # `spare` unused in this micro-batch, its bucket holds back itself and everything after it)
                ready = 3 if not unused else (4 if ph["spare"] else 2)
                assert ph["at_l0"] == ([] if variant == "serial" else buckets[:ready]), (cfg, ph)
