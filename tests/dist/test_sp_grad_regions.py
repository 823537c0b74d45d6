"""Sequence-parallel gradient regions: the replicated parameters' partial gradients are summed over tp by ONE
all-reduce per region (each block, ln_f, wpe) and every consumer of ``.grad`` sees the sum -- AdamW + clipping,
gradient accumulation (dp ``no_sync``), activation checkpointing (non-reentrant and reentrant), dp x tp, ZeRO 1-3.
Rank side: tests/dist/sp_grad_checks.py.

Tolerances: fp32 summation-order noise only (losses, clip norms and gradients 1e-5 relative to the tensor's
largest element; AdamW parameters after 3 steps 1e-4, its eps being 1e-5).
"""

from __future__ import annotations

import pytest

from tests.dist import sp_grad_checks as sc

F32 = 4
CFG = sc.TINY
L, H, T = CFG["n_layer"], CFG["n_embd"], CFG["block_size"]
# One backward's tp all-reduces, derived from the config: ln_f (weight + bias: 2h), each block (ln_1, ln_2
# weight + bias and the attn.proj / mlp.proj biases: 6h), then wpe (its dense (block_size, h) gradient).
REGIONS = [F32 * 2 * H] + [F32 * 6 * H] * L + [F32 * T * H]


def _check(res: dict, backwards: int) -> None:
    err = res["err"]
    assert all(n > sc.CLIP for n in res["ref_norms"]), res["ref_norms"]  # clipping really scaled the gradients
    assert err["loss"] < 1e-5 and err["norm"] < 1e-5, err
    assert err.get("grad", 0.0) < 1e-5, err
    assert err["param"] < 1e-4, err
    assert len(res["backwards"]) == backwards
    for got in res["backwards"]:  # one all-reduce per region per backward, none for the recomputation
        assert got == REGIONS, got


@pytest.mark.parametrize("ckpt,accum", [("none", 1), ("none", 3), ("layers", 2), ("reentrant", 1)])
def test_tp2_sp_adamw_clip(worlds, ckpt, accum):
    for res in worlds.get(2).run(sc.check_parity, {"tp": 2}, ckpt, accum):
        _check(res, sc.STEPS * accum)


def test_tp2_sp_collectives_through_shared_memory(worlds):
    # parallelize(algorithm="shm"): every tp collective of forward and backward (sequence all-gathers and
    # reduce-scatters, vocabulary loss, region all-reduces) runs through shared memory, same values
    for res in worlds.get(2).run(sc.check_parity, {"tp": 2}, "none", 1, None, "shm"):
        _check(res, sc.STEPS)
        assert res["algorithms"] == ["shm"], res["algorithms"]


@pytest.mark.parametrize("axes", [{"tp": 4}, {"dp": 2, "tp": 2}])
def test_world4_sp_accumulation_and_checkpointing(worlds, axes):
    # dp x tp: the data-parallel reducer's hooks read .grad after the tp sum; no_sync on the first micro-batch
    for res in worlds.get(4).run(sc.check_parity, axes, "layers", 2):
        _check(res, sc.STEPS * 2)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_with_sp(worlds, stage):
    for res in worlds.get(4).run(sc.check_zero_parity, stage, timeout=300):
        _check(res, sc.STEPS)


def test_zero3_units_finer_than_regions(worlds):
    # attention and MLP gathered separately: a block's region is not materialised at once, so each member
    # module (ln_1, attn.proj, ln_2, mlp.proj) sums its own parameters -- still correct, more messages
    units = [[f"blocks.{i}.{m}"] for i in range(L) for m in ("ln_1", "attn", "ln_2", "mlp")]
    per_member = [F32 * 2 * H] + [F32 * H, F32 * 2 * H, F32 * H, F32 * 2 * H] * L + [F32 * T * H]
    for res in worlds.get(4).run(sc.check_zero_parity, 3, units, timeout=300):
        assert res["err"]["loss"] < 1e-5 and res["err"]["norm"] < 1e-5 and res["err"]["param"] < 1e-4, res["err"]
        for got in res["backwards"]:
            assert got == per_member, got


def test_regions_and_parameters_restored(worlds):
    for res in worlds.get(2).run(sc.check_swaps_restored):
        # one region per block (its ModuleList element), plus wpe and ln_f on their own, in module order
        assert res["regions"] == ["wpe"] + [f"blocks.{i}" for i in range(L)] + ["ln_f"], res["regions"]
        assert res["raised"] == "boom"
        assert res["after_backward"] and res["after_no_grad"] and res["after_raise"], res
