"""Expert parallelism composed with pipelines and context parallelism, against one process.

* Library level (rank side: moe_pipeline_checks.py): ``sw.pipeline`` pp 2 × dp 2 with the experts over ep 2 inside
  each stage, every schedule kind, gradient accumulation, ZeRO-1. Tolerance: fp32, relative 1e-5 on every
  parameter (absolute on the balancing bias) after two AdamW steps.
* Runtime (rank side: moe_pipeline_runtime_checks.py): the trainer with pp 2 × ep 2 (1f1b, zb-h1 with ZeRO-1 and
  clipping, interleaved with the bias method, gpipe, capacity 1.0), cp 2 × ep 2 / ep 4 (ep folded into dp × cp,
  the balancing loss and capacity per whole sequence), pp 2 × cp 2 × ep 2, a Hugging Face mixtral under
  pp 2 × ep 2 (zb-h1) and cp 2 × ep 2; checkpoints of pipeline layouts resumed in others. Tolerance: logged losses relative 1e-5; parameters ‖p − p_ref‖ / ‖p_ref − p_init‖ ≤ 1e-5; routing
  loads equal one device's; all-to-alls counted per step."""

from __future__ import annotations

import pytest
import torch

from tests.dist import moe_pipeline_checks as mc
from tests.dist import moe_pipeline_runtime_checks as rc

RTOL = 1e-5
BASE = dict(pp=2, dp=2, ep=2, m=2)
CASES = [
    dict(BASE, schedule="1f1b", accum=2, clip=0.05),  # well below the gradient norm: clipping bites
    # zero-bubble: the balancing loss's gradient enters at the block output in B (into dL/dscores), the router
    # weight's gradient comes in W
    dict(BASE, schedule="zb-h1", accum=2),
    dict(BASE, schedule="gpipe", model=dict(capacity_factor=1.0)),
    dict(BASE, schedule="interleaved", chunks=2, accum=2),
    dict(BASE, schedule="zb-h1", zero=1, accum=2, model=dict(moe_bias_rate=0.01, moe_aux_loss_coef=0.0,
                                                             router="sigmoid")),
    dict(BASE, schedule="1f1b", zero=1, clip=0.05, model=dict(capacity_factor=1.0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()
                                                              if k not in ("pp", "dp", "ep", "m", "model"))
                         + ("-" + "-".join(c["model"]) if "model" in c else ""))
def test_moe_pipeline_equals_one_process(worlds, case):
    results = worlds.get(4).run(mc.run_case, case, timeout=240)
    passes = case.get("accum", 1) * case["m"]
    for rank, r in enumerate(results):
        assert r["err"] < RTOL, (rank, case, r["err"])
        assert r["in_buckets"] == 0 and r["n_experts"] == 2, r  # one MoE block per rank, outside the dp buckets
        for got, want in zip(r["losses"], r["ref"]):
            assert abs(got - want) <= RTOL * abs(want), (r["losses"], r["ref"])
        assert r["norms"] == pytest.approx(r["ref_norms"], rel=RTOL) and len(r["norms"]) == (2 if "clip" in case else 0)
        # per MoE block and micro-batch: 3 all-to-alls forward (counts, tokens out and back), 2 in backward —
        # zero-bubble included: its W runs each module's local backward (the router captured by its scores,
        # weight_grad.py), not the stage's whole backward again, which would repeat the token all-to-alls
        assert r["a2a"] == 5 * passes, (rank, r["a2a"])


def test_balancing_loss_weight_is_visible():
    """The parity above sees a lost balancing-loss gradient or a weight 1 / m instead of 1 / (m · accum)."""
    assert mc.aux_matters({}, 0.0) > 1e-2
    assert mc.aux_matters({}, 2.0) > 1e-2


# -- through the runtime (shardwise train's Trainer): ep with pp and with cp ----------------------------------------
NAMES = list(rc.LAYOUTS)
SAVED = {"pp2-ep2-zb-zero1-clip": "clip", "pp2-ep2-1f1b": "aux"}  # checkpointed at step K, resumed below


@pytest.fixture(scope="module")
def refs(worlds):
    return worlds.get(1).run(rc.check_references, list(rc.MODELS), timeout=300)[0]


@pytest.fixture(scope="module")
def runs(worlds, tmp_path_factory):
    dirs = {n: str(tmp_path_factory.mktemp(n)) for n in SAVED}
    per_rank = worlds.get(4).run(rc.check_layouts, NAMES, dirs, timeout=500)
    return per_rank, {n: per_rank[0][NAMES.index(n)]["checkpoint"] for n in SAVED}


def _update_error(params: dict, ref: dict, init: dict) -> float:
    """‖p − p_ref‖ / ‖p_ref − p_init‖ over the float tensors (AdamW at lr 0.01 moved every weight by ~0.01)."""
    keys = [k for k in init if init[k].is_floating_point() and "expert_bias" not in k]
    diff = sum(float((params[k] - ref[k]).pow(2).sum()) for k in keys) ** 0.5
    return diff / sum(float((ref[k] - init[k]).pow(2).sum()) for k in keys) ** 0.5


def _check_params(name: str, res: dict, params: dict, losses: list[float], init: dict) -> None:
    assert sorted(res["params"]) == sorted(params), name
    assert res["losses"] == pytest.approx(losses, rel=RTOL), (name, res["losses"], losses)
    assert _update_error(res["params"], params, init) <= RTOL, (name, _update_error(res["params"], params, init))
    for k in params:  # the selection bias moves by ±rate: equal, or off by a whole step
        if "expert_bias" in k:
            assert torch.allclose(res["params"][k], params[k], atol=1e-7), (name, k)


@pytest.mark.parametrize("name", NAMES)
def test_runtime_layout_matches_one_device(runs, refs, name):
    model, parallel = rc.LAYOUTS[name]
    ref = refs[model]
    init = ref["init"]
    pp = int(parallel.get("parallel.pp", "1"))
    for rank, results in enumerate(runs[0]):
        res = results[NAMES.index(name)]
        _check_params(name, res, ref["params"], ref["losses"][:rc.K], init)
        if model == "clip":  # the whole model's norm: every expert piece counted once (ep, edp, ZeRO-1's dp sum)
            assert res["norms"] == pytest.approx(ref["norms"][:rc.K], rel=RTOL), (name, res["norms"], ref["norms"])
        # routing statistics of every block (named as on one device; a pipeline rank gathers the other stages'):
        # loads summed, the balancing loss averaged over dp × cp
        for got, want in zip(res["stats"], ref["stats"]):
            assert list(got) == list(want), (name, got.keys())
            for block, row in got.items():
                for key in ("aux", "min", "max", "cv", "dropped", "starved"):
                    assert row[key] == pytest.approx(want[block][key], rel=RTOL, abs=1e-9), (name, block, key)
        # all-to-alls: 5 per MoE block and pass (3 forward, 2 backward), zero-bubble schedules too
        blocks = 2 // pp
        assert res["a2a"] == [5 * blocks * res["passes"]] * rc.K, (name, rank, res["a2a"])
        ep = int(parallel["parallel.ep"])
        assert [s[0] for s in res["experts_per_rank"]] == [4 // ep] * 2 * blocks, res["experts_per_rank"]


RESUMES = [("pp2-ep2-gpipe-clip", "pp2-ep2-zb-zero1-clip"), ("cp2-ep2-zero1-clip", "pp2-ep2-zb-zero1-clip"),
           ("cp2-ep2", "pp2-ep2-1f1b")]


def test_resume_across_layouts(worlds, runs, refs):
    """Step K + 1 from a pipeline checkpoint (ZeRO-1 flat groups plus the experts' own state; per-parameter state)
    in another pipeline schedule without ZeRO, and in cp × ep layouts."""
    pairs = [(name, runs[1][saved]) for name, saved in RESUMES]
    per_rank = worlds.get(4).run(rc.check_resumes, pairs, timeout=300)
    for i, (name, _) in enumerate(RESUMES):
        ref = refs[rc.LAYOUTS[name][0]]
        for results in per_rank:
            _check_params(f"resume {name}", results[i], ref["params_next"], ref["losses"][rc.K:], ref["init"])
