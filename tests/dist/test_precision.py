"""``train.precision = bf16`` (autocast compute, fp32 master weights) in every layout against one process running
the same model under the same autocast. Rank-side code: tests/dist/precision_checks.py.

Tolerances, and why. bf16 keeps 8 significant bits, so every rounded op has a relative error up to 2^-8 ≈ 3.9e-3;
a layout rounds at other places than one process does (a dp rank's weight gradient sums half the rows in bf16
before the fp32 all-reduce, tp all-reduces bf16 partial products), so bf16 layouts match the bf16 reference only
to bf16's noise, not bitwise as fp32 layouts do. Measured on this model (3 SGD steps) the noise is: losses ≤ 3e-4
apart (loss ≈ 5), the parameters' update (final − initial) ≤ 0.14% apart in norm — the same size as the gap between
the fp32 and the bf16 reference (0.2%). The bounds are ~7x and ~14x those measurements, far below what a real layout
bug gives (a gradient not averaged or not summed moves the update by tens of percent):

* ``LOSS_ATOL = 2e-3`` on each step's loss (≈ 4e-4 relative, a tenth of one bf16 rounding of the loss);
* ``UPDATE_RTOL = 2e-2``: ‖p_layout − p_ref‖ / ‖p_ref − p_init‖ over all parameters.

Since that noise cannot tell bf16 from fp32, bf16 is proven otherwise: every rank of every layout saw a module
return a bf16 tensor (autocast ran in each pipeline stage, too); the first step's loss (a forward on identical
weights) of each layout without tp equals the bf16 reference within ``FORWARD_ATOL = 1e-5`` — the same per-sequence
computation — while the fp32 reference is measurably further (5e-5); and the zero-bubble schedule's closed-form
weight gradients (``weight_grad.py``, bf16 operands) give 1F1B's autograd results to within fp32 noise (1e-6).
Parameters, gradients (as the non-finite guard reads them) and optimizer state stay fp32 in every layout.
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.runtime import trainer as trainer_mod
from shardwise.world import World
from tests.dist import precision_checks as pc

LOSS_ATOL = 2e-3
UPDATE_RTOL = 2e-2
FORWARD_ATOL = 1e-5
FP32 = {"torch.float32"}


@pytest.fixture(scope="module")
def refs(one_rank_mesh):
    """One process (world of one, this test process), fp32 and bf16, on the same seed and batches."""
    world = World(rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_mod, "_build_mesh", trainer_mod._build_mesh)  # run_layout replaces it: restore after
        return {p: pc.run_layout({"parallel.nproc": "1"}, p, world, lambda **_: one_rank_mesh)
                for p in ("fp32", "bf16")}


def _update_error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                  init: dict[str, torch.Tensor]) -> float:
    diff = math.sqrt(sum(float((params[k] - ref[k]).pow(2).sum()) for k in init))
    moved = math.sqrt(sum(float((ref[k] - init[k]).pow(2).sum()) for k in init))
    return diff / moved


def _check(name: str, res: dict, ref: dict, init: dict[str, torch.Tensor]) -> None:
    assert "torch.bfloat16" in res["output_dtypes"], (name, res["output_dtypes"])  # autocast ran on this rank
    for kind in ("grad_dtypes", "param_dtypes", "opt_dtypes"):
        assert res[kind] == FP32, (name, kind, res[kind])
    diffs = [abs(a - b) for a, b in zip(res["losses"], ref["losses"])]
    assert len(diffs) == pc.K and max(diffs) <= LOSS_ATOL, (name, res["losses"], ref["losses"])
    assert _update_error(res["params"], ref["params"], init) <= UPDATE_RTOL, name
    if "tp" not in name:  # tp splits each matmul's sum, so even the first forward rounds differently
        assert diffs[0] <= FORWARD_ATOL, (name, diffs[0])
    if name.startswith("pp"):  # the GPT's residual stream (bf16 branches added to it promote) crosses in fp32
        assert res["boundary"] == FP32, (name, res["boundary"])


def test_bf16_reference_computes_in_bf16_with_fp32_state(refs):
    fp32, bf16 = refs["fp32"], refs["bf16"]
    assert "torch.bfloat16" in bf16["output_dtypes"] and fp32["output_dtypes"] == FP32
    for kind in ("grad_dtypes", "param_dtypes", "opt_dtypes"):
        assert bf16[kind] == FP32 and fp32[kind] == FP32, kind
    # the forward-only first loss tells the two precisions apart well above FORWARD_ATOL
    assert abs(fp32["losses"][0] - bf16["losses"][0]) > 2 * FORWARD_ATOL, (fp32["losses"], bf16["losses"])


def test_bf16_layouts_match_one_process(worlds, refs):
    names = list(pc.LAYOUTS)
    per_rank = worlds.get(2).run(pc.check_layouts, names, "bf16", timeout=300)
    init = pc.initial_params()
    for k, name in enumerate(names):
        for res in (ranks[k] for ranks in per_rank):
            _check(name, res, refs["bf16"], init)
    # Zero-bubble W (closed forms on bf16 gradients) = 1F1B's autograd backward, to fp32 noise.
    zb, f1b = per_rank[0][names.index("pp2-zbh1")], per_rank[0][names.index("pp2-1f1b-ckpt")]
    assert max(abs(a - b) for a, b in zip(zb["losses"], f1b["losses"])) <= 1e-6
    assert max(float((zb["params"][n] - f1b["params"][n]).abs().max()) for n in init) <= 1e-6


def test_bf16_crosses_a_stage_boundary(worlds):
    """A stage ending in a Linear sends bf16 under autocast (receive buffer from the metadata, bf16 gradient back);
    loss and gradients equal the same model on one rank under the same autocast."""
    for res in worlds.get(2).run(pc.check_bf16_boundary):
        assert res["boundary"] == {"torch.bfloat16"} and res["grad_dtypes"] == FP32, res
        assert res["loss_err"] <= 1e-6 and res["grad_err"] <= 1e-6, res


def test_bf16_hybrids_match_one_process(worlds, refs):
    names = list(pc.HYBRIDS)
    per_rank = worlds.get(4).run(pc.check_layouts, names, "bf16", timeout=300)
    init = pc.initial_params()
    for k, name in enumerate(names):
        for res in (ranks[k] for ranks in per_rank):
            _check(name, res, refs["bf16"], init)
