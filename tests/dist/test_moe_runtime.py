"""``parallel.ep`` through the trainer against one device (same seed, same batches, AdamW): plain data parallelism,
ZeRO-1 and ZeRO-3, tensor parallelism, with the balancing loss, capacity 1.0, the bias method (sigmoid router) and
gradient clipping; checkpoints resumed across ep. Rank-side code: tests/dist/moe_runtime_checks.py.

Tolerances (fp32): each logged loss within relative 1e-5 of one device's; every gathered parameter within
relative 1e-5 of one device's, measured as ‖p − p_ref‖ / ‖p_ref − p_init‖ (the update's error: after K = 2
AdamW steps at lr 0.01 the weights moved by ~0.01 per element); the routing statistics of every step (loads
summed over the data-parallel ranks) equal one device's. All-to-alls per step are counted: per MoE layer and
forward/backward pass, three forward (the counts, the tokens out and back) and two backward (the tokens' way
back and out again; three more with activation checkpointing, which recomputes the forward), none without ep.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from shardwise.runtime import experts as experts_mod
from shardwise.runtime import trainer as trainer_mod
from shardwise.world import World
from tests.dist import moe_runtime_checks as mc

RTOL = 1e-5
LAYERS = 2  # every layer of SMALL is an MoE layer
TWO = ["ep2", "ep2-capacity", "ep2-bias", "ep2-clip", "ep2-zero1", "ep2-zero2", "ep2-zero3-clip", "ep1-dp2",
       "ep2-ckpt"]
FOUR = ["ep4", "ep2xdp2-zero1", "ep2xdp2-zero3-clip", "ep2xtp2-clip", "ep2xtp2-bias", "ep2xtp2-zero3"]


@pytest.fixture(scope="module")
def refs(one_rank_mesh):
    world = World(rank=0, world_size=1, local_rank=0, backend="gloo", device=torch.device("cpu"))
    with pytest.MonkeyPatch.context() as mp:  # the checks replace them: restore after
        mp.setattr(trainer_mod, "_build_mesh", trainer_mod._build_mesh)
        mp.setattr(experts_mod, "expert_mesh", experts_mod.expert_mesh)
        return {m: mc.run_reference(m, world, lambda **_: one_rank_mesh) for m in mc.MODELS}


@pytest.fixture(scope="module")
def init():
    """The weights every layout of a model variant starts from (the seeded GPT on one device, before any step)."""
    from shardwise.parallel.common.materialize import ensure_sources, materialize
    from shardwise.runtime.model_build import meta_model_for

    out = {}
    for m in mc.MODELS:
        model = meta_model_for(mc.config({**mc.MODELS[m], "parallel.nproc": "1"}))
        ensure_sources(model)
        materialize(model, torch.device("cpu"))
        out[m] = {k: v.detach().float() for k, v in model.state_dict().items()}
    return out


def _update_error(params: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                  init: dict[str, torch.Tensor]) -> float:
    keys = [k for k in init if init[k].is_floating_point() and "expert_bias" not in k]
    diff = math.sqrt(sum(float((params[k] - ref[k]).pow(2).sum()) for k in keys))
    moved = math.sqrt(sum(float((ref[k] - init[k]).pow(2).sum()) for k in keys))
    return diff / moved


def _check_run(name: str, res: dict, ref: dict, init: dict, losses: list[float], params: dict) -> None:
    assert sorted(res["params"]) == sorted(init), name
    assert res["losses"] == pytest.approx(losses, rel=RTOL), (name, res["losses"], losses)
    worst = {k: _update_error({k: res["params"][k]}, {k: params[k]}, {k: init[k]}) for k in init
             if init[k].is_floating_point() and "expert_bias" not in k}
    assert _update_error(res["params"], params, init) <= RTOL, (name, _update_error(res["params"], params, init),
                                                                sorted(worst.items(), key=lambda kv: -kv[1])[:4])
    for k in init:  # the selection bias (bias method) moves by ±rate: equal exactly or off by a whole step
        if "expert_bias" in k:
            assert torch.allclose(res["params"][k], params[k], atol=1e-7), (name, k)


def _check(names: list[str], per_rank: list[list[dict]], refs: dict, init: dict, ranks: int) -> None:
    for i, name in enumerate(names):
        model, parallel = mc.LAYOUTS[name]
        ref = refs[model]
        ep = int(parallel["parallel.ep"])
        tp = int(parallel.get("parallel.tp", "1"))
        passes = 8 // 2 // (ranks // tp)  # global batch 8, micro-batch 2, over the dp ranks
        for rank, results in enumerate(per_rank):
            res = results[i]
            _check_run(name, res, ref, init[model], ref["losses"][:mc.K], ref["params"])
            for got, want in zip(res["stats"], ref["stats"]):
                assert got is not None and got.keys() == want.keys(), name
                for block in want:
                    assert got[block] == pytest.approx(want[block], rel=RTOL, abs=1e-9), (name, block, got, want)
            if model == "clip":  # the norm before clipping, over every expert once (pieces summed over ep)
                assert all(n > 4 * 0.05 for n in ref["norms"]), ref["norms"]
                assert res["norms"] == pytest.approx(ref["norms"][:mc.K], rel=RTOL), (name, res["norms"], ref["norms"])
            a2a = [ops.get("all_to_all", 0) for ops in res["ops"]]
            # activation checkpointing recomputes each block's forward in backward: its three all-to-alls again
            per_pass = 8 if parallel.get("parallel.activation_checkpointing") == "true" else 5
            assert a2a == [LAYERS * passes * per_pass if ep > 1 else 0] * mc.K, (name, rank, a2a)
            want_shape = 4 // ep if ep > 1 else None
            assert all(s[0] == want_shape for s in res["experts_per_rank"]) and (
                len(res["experts_per_rank"]) == (2 * LAYERS if ep > 1 else 0)), (name, res["experts_per_rank"])


@pytest.fixture(scope="module")
def saved(worlds, tmp_path_factory, refs, init):
    """The 2-rank layouts against one device; ep2, ep2-bias and ep2-zero1 also checkpoint their step K."""
    dirs = {n: str(tmp_path_factory.mktemp(n)) for n in ("ep2", "ep2-bias", "ep2-zero1")}
    per_rank = worlds.get(2).run(mc.check_layouts, TWO, dirs, timeout=400)
    return per_rank, {n: per_rank[0][TWO.index(n)]["checkpoint"] for n in dirs}


def test_two_rank_layouts_match_one_device(saved, refs, init):
    _check(TWO, saved[0], refs, init, 2)
    for results in saved[0]:  # ep 2 = dp under ZeRO: no edp replica to share the experts' Adam state with
        res = results[TWO.index("ep2-zero1")]
        assert res["expert_state_numel"] == res["expert_numel"] > 0, res


@pytest.fixture(scope="module")
def four(worlds, tmp_path_factory, refs, init):
    """The 4-rank layouts; ep4 and ep2xdp2-zero1 (the experts' optimizer state sharded over edp) checkpoint
    their step K."""
    dirs = {n: str(tmp_path_factory.mktemp(n)) for n in ("ep4", "ep2xdp2-zero1")}
    per_rank = worlds.get(4).run(mc.check_layouts, FOUR, dirs, timeout=500)
    return per_rank, {n: per_rank[0][FOUR.index(n)]["checkpoint"] for n in dirs}


def test_four_rank_layouts_match_one_device(four, refs, init):
    _check(FOUR, four[0], refs, init, 4)
    for results in four[0]:  # ep 2 × edp 2 under ZeRO: each edp rank keeps half its experts' Adam state
        res = results[FOUR.index("ep2xdp2-zero1")]
        assert abs(res["expert_state_numel"] - res["expert_numel"] / 2) <= 1, res["expert_state_numel"]
    index = json.loads((Path(four[1]["ep2xdp2-zero1"]) / "index.json").read_text())
    for c in (0, 1):
        entry = index["tensors"][f"zero/experts.ep{c}/exp_avg"]
        assert entry["axes"] == ["edp", "tp"] and entry["sbp"] == "S(0),B", entry


def test_resume_across_ep(worlds, saved, four, refs, init):
    """Step K + 1 from a checkpoint of another layout: ep 2 → ep 4, ep 2 → ep 2 × tp 2 (bias method: the bias
    buffer too), ep 2 → ep 2 × tp 2 with ZeRO-3, ep 2 with ZeRO-1 → ep 4 (the experts' own optimizer state),
    ep 2 → ep 2 × edp 2 with ZeRO-1 (the experts' state sharded over edp) and that layout onto itself, on 4 ranks;
    ep 4 → ep 2 and ep 4 → ep 1, ep 2 × edp 2 ZeRO-1 → ep 2 and → ep 2 ZeRO-1 (edp 1), on 2 ranks."""
    cases = {4: [("ep4", saved[1]["ep2"]), ("ep2xtp2-bias", saved[1]["ep2-bias"]),
                 ("ep2xtp2-zero3", saved[1]["ep2"]), ("ep4", saved[1]["ep2-zero1"]),
                 ("ep2xdp2-zero1", saved[1]["ep2"]), ("ep2xdp2-zero1", four[1]["ep2xdp2-zero1"])],
             2: [("ep2", four[1]["ep4"]), ("ep1-dp2", four[1]["ep4"]), ("ep2", four[1]["ep2xdp2-zero1"]),
                 ("ep2-zero1", four[1]["ep2xdp2-zero1"])]}
    for n, pairs in cases.items():
        per_rank = worlds.get(n).run(mc.check_resumes, pairs, timeout=300)
        for i, (name, _) in enumerate(pairs):
            ref = refs[mc.LAYOUTS[name][0]]
            for results in per_rank:
                _check_run(f"resume {name}", results[i], ref, init[mc.LAYOUTS[name][0]], ref["losses"][mc.K:],
                           ref["params_next"])


def test_starved_expert_is_warned_once_per_streak():
    """Pure: an expert without a token for ``STARVED_STEPS`` consecutive steps gets one warning line per streak."""
    from shardwise.runtime.experts import STARVED_STEPS, Experts

    ex = Experts(torch.nn.Module(), None, None, 1)  # type: ignore[arg-type]  # no collective is reached here
    quiet, busy = torch.tensor([[3.0, 0.0, 5.0, 8.0]]), torch.tensor([[3.0, 1.0, 5.0, 7.0]])
    seen = []
    for loads in [quiet] * (STARVED_STEPS - 1) + [busy] + [quiet] * (2 * STARVED_STEPS):
        ex._count_quiet(["blocks.0.mlp"], loads)
        seen.append(ex.warnings())
    lines = [(i, w) for i, ws in enumerate(seen) for w in ws]
    assert [i for i, _ in lines] == [2 * STARVED_STEPS - 1], lines  # the streak broken at step 20: warned at 40
    assert "blocks.0.mlp expert 1" in lines[0][1] and f"{STARVED_STEPS} consecutive steps" in lines[0][1]


def test_nonfinite_expert_gradient_skips_the_step_everywhere(worlds):
    """A NaN in one expert piece's gradient on one rank only: every rank skips the step (plain and ZeRO-1)."""
    names = ["ep2", "ep2-zero1"]
    for results in worlds.get(2).run(mc.check_nonfinite, names, timeout=200):
        for name, res in zip(names, results):
            assert res == {"skipped": True, "unchanged": True}, (name, res)
