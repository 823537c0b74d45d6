"""``optimizer.clip_grad_norm`` in every layout of the trainer against one device running
``torch.nn.utils.clip_grad_norm_`` over the whole model (same seed, same batches, SGD). Rank-side code:
tests/dist/clip_checks.py.

Per layout and step: the norm the trainer logged equals the reference's (relative 1e-5 in fp32) on every rank, and
after ``K`` clipped steps the gathered weights equal the reference's: ‖p − p_ref‖ / ‖p_ref − p_init‖ ≤ 1e-5 in
fp32 (measured: ~1e-8, summation order). Clipping bites: every norm is > 4 × ``MAX_NORM`` (measured ~70x), so
torch scaled the reference's gradients by < 1/4 and a layout that did not clip (or clipped by another norm) would
move its weights several times the reference's update (unclipped vs clipped reference: 1.5).
bf16 (autocast) layouts match a bf16 reference to bf16's noise, not bitwise (a dp rank sums other rows in bf16):
measured norm 1.1e-4 and update 2.8e-5 apart, bounded by 2e-3 and 1e-3 (see test_precision.py for bf16's noise).
The collectives each clipping call adds are counted: one all-reduce of one number per axis whose ranks hold
different gradient pieces, none over dp without ZeRO (replicas hold identical gradients); with clipping off a step
runs exactly the collectives it ran before.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.runtime import trainer as trainer_mod
from shardwise.world import World
from tests.dist import clip_checks as cc

NORM_RTOL = 1e-5
UPDATE_RTOL = 1e-5
BF16_NORM_RTOL, BF16_UPDATE_RTOL = 2e-3, 1e-3

# What each clipping call communicates (sorted): one sum all-reduce of one fp32 number per axis listed.
CLIP_COLLECTIVES = {
    "dp2": [], "tp2-ckpt": ["all_reduce@tp"], "zero1": ["all_reduce@dp"], "zero2": ["all_reduce@dp"],
    "zero3": ["all_reduce@dp"], "pp2": ["all_reduce@pp"], "zero2-bf16": ["all_reduce@dp"],
    "dp2xtp2": ["all_reduce@tp"], "zero3xtp2": ["all_reduce@dp", "all_reduce@tp"], "pp2xdp2": ["all_reduce@pp"],
    "pp2xdp2-zero1": ["all_reduce@dp", "all_reduce@pp"], "pp2xtp2-ckpt": ["all_reduce@pp", "all_reduce@tp"],
}


@pytest.fixture(scope="module")
def refs(one_rank_mesh):
    """One device (a world of one, this test process), clipped by torch: fp32 and bf16."""
    world = World(rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_mod, "_build_mesh", trainer_mod._build_mesh)  # the checks replace it: restore after
        run = lambda precision, clip: cc.run_reference(precision, clip, world, lambda **_: one_rank_mesh)  # noqa: E731
        return {"fp32": run("fp32", cc.MAX_NORM), "bf16": run("bf16", cc.MAX_NORM)}


def _update_error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                  init: dict[str, torch.Tensor]) -> float:
    diff = math.sqrt(sum(float((params[k] - ref[k]).pow(2).sum()) for k in init))
    moved = math.sqrt(sum(float((ref[k] - init[k]).pow(2).sum()) for k in init))
    return diff / moved


def _check(name: str, per_rank: list[dict], ref: dict, init: dict[str, torch.Tensor], norm_rtol: float,
           update_rtol: float) -> None:
    for rank, res in enumerate(per_rank):
        assert len(res["norms"]) == cc.K and len(ref["norms"]) == cc.K
        for got, want in zip(res["norms"], ref["norms"]):
            assert got > 4 * cc.MAX_NORM, (name, got)  # clipping bites
            assert got == pytest.approx(want, rel=norm_rtol), (name, rank, res["norms"], ref["norms"])
        assert sorted(res["params"]) == sorted(init), name
        assert _update_error(res["params"], ref["params"], init) <= update_rtol, (name, rank)
        assert res["calls"] == [CLIP_COLLECTIVES[name]] * cc.K, (name, rank, res["calls"])


def test_two_rank_layouts_match_one_device(worlds, refs):
    names = list(cc.LAYOUTS) + list(cc.BF16)
    per_rank = worlds.get(2).run(cc.check_layouts, names, timeout=300)
    init = cc.initial_params()
    for i, name in enumerate(names):
        bf16 = name in cc.BF16
        _check(name, [r[i] for r in per_rank], refs["bf16" if bf16 else "fp32"], init,
               BF16_NORM_RTOL if bf16 else NORM_RTOL, BF16_UPDATE_RTOL if bf16 else UPDATE_RTOL)


def test_four_rank_hybrids_match_one_device(worlds, refs):
    names = list(cc.HYBRIDS)
    per_rank = worlds.get(4).run(cc.check_layouts, names, timeout=300)
    init = cc.initial_params()
    for i, name in enumerate(names):
        _check(name, [r[i] for r in per_rank], refs["fp32"], init, NORM_RTOL, UPDATE_RTOL)


def test_clipping_off_adds_no_collective(worlds):
    names = ["zero3", "pp2"]
    per_rank = worlds.get(2).run(cc.check_step_collectives, names, timeout=300)
    for i, name in enumerate(names):
        for results in per_rank:
            off, on = results[i][0.0], results[i][cc.MAX_NORM]
            assert off["calls"] == 0 and on["calls"] == 1, (name, off, on)
            added = dict(on["ops"])
            for op in CLIP_COLLECTIVES[name]:
                added[op] -= 1
            assert added == off["ops"], (name, off["ops"], on["ops"])
