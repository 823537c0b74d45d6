"""ZeRO 1-3 over dp with tensor parallelism inside (dp 2 × tp 2, 4 ranks) against one process training the same
GPT with AdamW and gradient clipping. Rank side: tests/dist/zero_tp_checks.py.

Tolerance: fp32, relative 1e-5 (as the ZeRO and pipeline-hybrid tests). Besides values, the communication
pattern of every step: ZeRO's reduce-scatters and all-gathers run on the dp group (2 ranks) and move this tp
rank's *local* parameters (half the model's elements here, not all of them); the tp collectives of forward and
backward are exactly those of the same tp model without ZeRO; clipping adds one all-reduce of one number per axis.
"""

from __future__ import annotations

import pytest

from tests.dist import zero_tp_checks as zc

RTOL = 1e-5
F32, F64 = 4, 8  # bytes: gradients and parameters; the clip norm's partial sum


def _op(summary: dict, key: str) -> tuple[int, int]:
    return tuple(summary["ops"].get(key, [0, 0]))  # type: ignore[return-value]


def _expected_zero(res: dict, stage: int) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int]]]:
    """(forward+backward, clip+step) dp collectives: {"dp:op": (count, bytes of this rank's inputs or None)}."""
    groups, local, shard = res["groups"], res["local_numel"] * F32, res["shard_numel"] * F32
    rs = (groups, local)  # each group's full local (tp-shard) flat gradient, reduce-scattered over dp
    ag = (groups, shard)  # each group's dp shard of it, all-gathered over dp
    clip = {"dp:all_reduce": (1, F64)}
    if stage in (1, 2):  # both reduce-scatter every bucket during backward; the step only all-gathers
        return {"dp:reduce_scatter": rs}, {"dp:all_gather": ag, **clip}
    blocks = res["blocks"]  # stage 3: forward gathers every unit, backward the blocks again (rest unit kept)
    return {"dp:reduce_scatter": rs, "dp:all_gather": (groups + blocks, None)}, clip


def test_zero_stages_with_tp_match_one_process(worlds):
    stages = [1, 2, 3]
    per_rank = worlds.get(4).run(zc.check_parity, stages, timeout=300)
    for results in per_rank:
        for res, stage in zip(results, stages):
            assert all(n > zc.CLIP for n in res["ref_norms"]), res["ref_norms"]  # clipping really happened
            assert res["norm_err"] < RTOL, (stage, res["norm_err"])  # the one-process norm: tp replicas once
            assert res["loss_err"] < RTOL, (stage, res["loss_err"])
            assert res["param_err"] < RTOL, (stage, res["param_err"])
            assert res["keys_ok"] and res["shapes_ok"], stage  # full_state_dict: plain keys, full shapes
            _check_comm(res, stage)
    for stage_index, stage in enumerate(stages):  # the dp shards of one tp coordinate cover its local parameters
        for tp in (0, 1):
            peers = [r[stage_index] for r in per_rank if r[stage_index]["tp"] == tp]
            assert sum(p["shard_numel"] for p in peers) == peers[0]["local_numel"], (stage, tp)


def _check_comm(res: dict, stage: int) -> None:
    assert res["local_numel"] < 0.7 * res["full_numel"], res  # tp shards, not the whole model, are ZeRO's
    want_pass, want_step = _expected_zero(res, stage)
    for passes, steps in zip(res["passes"], res["steps"]):
        # nothing on the whole world or another group: every collective on dp or tp, groups of 2
        assert passes["groups"] == [("dp", 2), ("tp", 2)] or passes["groups"] == [("tp", 2)], passes["groups"]
        dp_pass = {k: tuple(v) for k, v in passes["ops"].items() if k.startswith("dp:")}
        for key, (count, nbytes) in want_pass.items():
            got = dp_pass.pop(key, (0, 0))
            assert got[0] == count and nbytes in (None, got[1]), (stage, key, got, (count, nbytes))
        assert not dp_pass, (stage, dp_pass)  # no other dp collective in forward/backward
        # tensor parallelism's own collectives are unchanged by ZeRO
        tp_pass = {k: v for k, v in passes["ops"].items() if k.startswith("tp:")}
        assert tp_pass == {k: v for k, v in res["plain_tp"]["ops"].items() if k.startswith("tp:")}, (stage, tp_pass)
        assert {k: tuple(v) for k, v in steps["ops"].items()} == {**want_step, "tp:all_reduce": (1, F64)}, \
            (stage, steps)
    if stage == 3:  # forward/backward all-gathers move this rank's shards: each unit once forward, blocks again
        _, nbytes = _op(res["passes"][-1], "dp:all_gather")
        assert res["shard_numel"] * F32 < nbytes < 2 * res["shard_numel"] * F32, (nbytes, res["shard_numel"])


@pytest.mark.parametrize("stages", [(3, 1), (1, 2), (2, 3)], ids=["zero3-to-zero1", "zero1-to-zero2", "zero2-to-zero3"])
def test_checkpoint_of_zero_with_tp_resumes_exactly(worlds, tmp_path, stages):
    per_rank = worlds.get(4).run(zc.check_checkpoint, *stages, str(tmp_path), timeout=300)
    for res in per_rank:
        # one flat state per group and tp coordinate, S(0) over dp (the key names the tp coordinate)
        assert res["zero_keys"] and all(".tp0/" in k or ".tp1/" in k for k in res["zero_keys"]), res["zero_keys"]
        assert {k.replace(".tp1/", ".tp0/") for k in res["zero_keys"]} == \
            {k for k in res["zero_keys"] if ".tp0/" in k}, res["zero_keys"]
        assert all(info == ("S(0)", ["dp"], 2) for info in res["zero_info"].values()), res["zero_info"]
        assert res["qkv"] == ("B,S(1)", "B,B"), res["qkv"]  # parameters saved as tp shards, replicated ones once
        assert res["state_names"] == res["ref_names"]
        assert res["saved_err"] < RTOL and res["state_err"] < 1e-4, res  # exp_avg: float noise of small values
        assert res["loss_err"] < RTOL and res["param_err"] < RTOL, res
        _check_save_gathers_nothing(res)
    # every parameter element written exactly once over the 4 ranks (the tied head once, as wte)
    assert sum(res["model_written"] for res in per_rank) == per_rank[0]["full_numel"], per_rank


def _check_save_gathers_nothing(res: dict) -> None:
    """The save of a ZeRO x tp rank: its own flat ranges (``BlockRangePiece``), no all-gather over dp — only the
    finite check's one-number max over each axis — and no more parameter elements than its shard (tp coordinate 1
    leaves the tp-replicated ones to coordinate 0). Gathering over dp made dp rank 0 write its whole tp piece."""
    assert res["save_ops"] == {"dp:all_reduce": [1, F32], "tp:all_reduce": [1, F32]}, res["save_ops"]
    if res["tp"] == 0:
        assert res["model_written"] == res["shard_numel"], res
    else:
        assert res["model_written"] <= res["shard_numel"], res


def test_pipeline_zero1_with_tp_checkpoint_round_trip(worlds, tmp_path):
    # pp 2 × dp 2 × tp 2: the ZeRO-1 flat state of every (pp, tp) coordinate under its own key, S(0) over dp
    for res in worlds.get(8).run(zc.check_pipeline_zero1_checkpoint, str(tmp_path), timeout=300):
        assert len(res["keys"]) >= 4 and {k.split("/")[1].split(".")[0] for k in res["keys"]} == {"pp0", "pp1"}
        assert {k.split("/")[1].rpartition(".")[2] for k in res["keys"]} == {"tp0", "tp1"}, res["keys"]
        assert res["info"] == [("S(0)", ("dp",), 2)], res["info"]  # written by the 2 dp ranks of its pp, tp coordinate
        assert res["names_ok"] and res["state_err"] < 1e-4, res
        assert res["loaded_exact"], res
