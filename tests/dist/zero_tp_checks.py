"""Rank-side checks for ZeRO with tensor parallelism inside (``sw.zero(sw.parallelize(gpt, mesh, axis="tp"), mesh,
axis="dp")`` on a ``(dp=2, tp=2)`` mesh; run inside LocalWorld ranks by tests/dist/test_zero_tp.py).

The reference is one process training the same GPT (same seed) on the whole batch with plain ``torch.optim.AdamW``
and ``torch.nn.utils.clip_grad_norm_``. The model has biases (a row-parallel layer's bias is replicated over tp,
like the layer norms: the clip norm must count those once) and an odd vocabulary (37 rows: uneven tp shards of
the tied embedding, so each tp coordinate's flat groups have another length).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

import shardwise as sw
from shardwise.checkpoint.layout import tied_aliases
from shardwise.checkpoint.sharded import Checkpoint, save_checkpoint
from shardwise.checkpoint.zero_layout import load_zero, param_state, zero_index_state, zero_model_pieces, \
    zero_optimizer_pieces
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.tensor.apply_plan import gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

TINY = GPTConfig(vocab_size=37, block_size=8, n_layer=2, n_head=2, n_embd=12, bias=True)
GLOBAL_B, SEQ, STEPS, CLIP = 8, 6, 4, 0.05
# eps 1e-5 as in the ZeRO tests: AdamW's m/sqrt(v) of near-zero gradients (the key biases) amplifies float
# summation-order noise past the tolerance with the default 1e-8
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5, weight_decay=0.1)
SMALL_BUCKETS = dict(bucket_cap_mb=900 / 2**20, first_bucket_mb=300 / 2**20)  # several flat groups in stages 1-2


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x = torch.randint(0, TINY.vocab_size, (GLOBAL_B, SEQ + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def reference(steps: int = STEPS) -> dict[str, Any]:
    """One process: losses, clip norms, and after ``steps // 2`` and ``steps`` steps the parameters and AdamW's
    ``exp_avg`` per parameter name."""
    torch.manual_seed(0)
    model = GPT(TINY)
    opt = ADAMW(model.parameters())
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, Any] = {"losses": [], "norms": []}
    for s, (x, y) in enumerate(_batches(steps)):
        loss = lm_loss(model(x), y)
        loss.backward()
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        if s + 1 in (steps // 2, steps):
            out[f"params{s + 1}"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
            out[f"exp_avg{s + 1}"] = {names[id(p)]: st["exp_avg"].clone() for p, st in opt.state.items()}
    return out


_REF: dict[int, dict[str, Any]] = {}


def cached_reference() -> dict[str, Any]:
    if STEPS not in _REF:
        _REF[STEPS] = reference()
    return _REF[STEPS]


def build(stage: int, seed: int = 0) -> tuple[sw.Mesh, torch.nn.Module, Any, int]:
    """``(mesh, ZeroModel, ZeroOptimizer, elements of this tp rank's local parameters)``."""
    m = mesh(dp=2, tp=2)
    torch.manual_seed(seed)
    tp_model = sw.parallelize(GPT(TINY), m, gpt_plan(TINY), axis="tp", seed=seed)
    local_numel = sum(p.numel() for p in tp_model.parameters())  # each tp shard (and replicated tensor) once
    model, opt = sw.zero(tp_model, m, stage=stage, optimizer=ADAMW, **SMALL_BUCKETS)
    return m, model, opt, local_numel


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / (1e-3 + b.double().abs().max()))


def _summary(c: CommCounter) -> dict[str, Any]:
    """Count and bytes per (axis, op), and every (axis, group size) seen."""
    ops: dict[str, list[int]] = {}
    for r in c.records:
        entry = ops.setdefault(f"{r.axis}:{r.op}", [0, 0])
        entry[0] += 1
        entry[1] += r.nbytes
    return {"ops": ops, "groups": sorted({(r.axis, r.group_size) for r in c.records})}


def train(m: sw.Mesh, model: Any, opt: Any, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Train on this dp rank's half of each batch; losses (dp mean), clip norms, per-step comm summaries."""
    d, per = m.coord("dp"), GLOBAL_B // m.size("dp")
    losses, norms, passes, steps = [], [], [], []
    for x, y in batches:
        with CommCounter() as cp:
            loss = vocab_parallel_cross_entropy(model(x[d * per:(d + 1) * per]), y[d * per:(d + 1) * per],
                                                mesh=m, axis="tp")
            loss.backward()
        with CommCounter() as cs:
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
        passes.append(_summary(cp))
        steps.append(_summary(cs))
        total = loss.detach().clone()
        sw.comm.all_reduce(total, m, "dp", op="avg")
        losses.append(float(total))
    return {"losses": losses, "norms": norms, "passes": passes, "steps": steps}


def plain_tp_pass_summary() -> dict[str, Any]:
    """The comm summary of one forward/backward of the same tp model without ZeRO (the tp collectives)."""
    m = mesh(dp=2, tp=2)
    torch.manual_seed(0)
    model = sw.parallelize(GPT(TINY), m, gpt_plan(TINY), axis="tp", seed=0)
    x, y = _batches(1)[0]
    with CommCounter() as c:
        vocab_parallel_cross_entropy(model(x[:GLOBAL_B // 2]), y[:GLOBAL_B // 2], mesh=m, axis="tp").backward()
    return _summary(c)


def check_parity(stages: list[int]) -> list[dict[str, Any]]:
    """Each stage: STEPS steps of AdamW + clipping vs one process (losses, norms, parameters), and the comm
    pattern of every step."""
    ref = cached_reference()
    plain = plain_tp_pass_summary()
    out = []
    for stage in stages:
        m, model, opt, local_numel = build(stage)
        got = train(m, model, opt, _batches())
        full = sw.full_state_dict(model)  # collective over dp and tp: the plain model's full tensors
        out.append({
            "stage": stage, "tp": m.coord("tp"), "dp": m.coord("dp"),
            "loss_err": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
            "norm_err": max(abs(a - b) / b for a, b in zip(got["norms"], ref["norms"])),
            "ref_norms": ref["norms"],
            "param_err": max(_rel(full[k], v) for k, v in ref[f"params{STEPS}"].items()),
            "keys_ok": sorted(full) == sorted(ref[f"params{STEPS}"]),
            "shapes_ok": all(tuple(full[k].shape) == tuple(v.shape) for k, v in ref[f"params{STEPS}"].items()),
            "passes": got["passes"], "steps": got["steps"], "plain_tp": plain,
            "groups": len(model.groups), "blocks": len(model.groups) - (1 if stage == 3 else 0),
            "local_numel": local_numel, "full_numel": sum(p.numel() for p in GPT(TINY).parameters()),
            "shard_numel": sum(g.hi - g.lo for g in model.groups),
        })
    return out


def check_checkpoint(stage_from: int, stage_to: int, root: str) -> dict[str, Any]:
    """Train STEPS/2 steps under ZeRO ``stage_from`` × tp, save a sharded checkpoint, read it back per parameter
    (vs the one-process parameters and AdamW state), load it into a fresh ``stage_to`` × tp model built from
    another seed and train the remaining steps: the one-process run's losses and parameters."""
    ref = cached_reference()
    half = STEPS // 2
    m, model, opt, _ = build(stage_from)
    train(m, model, opt, _batches()[:half])
    shared, mine = zero_index_state(model)
    state = {**shared, "aliases": tied_aliases(model)}  # lm_head.weight is wte.weight: saved once, as the trainer does
    with CommCounter() as saving:  # pieces and save: each rank's own ranges, nothing gathered over dp
        pieces = zero_model_pieces(model, m) + zero_optimizer_pieces(model, opt, m)
        save_checkpoint(Path(root), half, pieces, mesh=m, state=state, rank_state=mine)
    ckpt = Checkpoint(Path(root))
    with safe_open(str(ckpt.path / f"rank{m.rank:05d}.safetensors"), framework="pt") as f:
        written = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys() if k.startswith("model/"))
    owned = {"tp": m.coord("tp"), "shard_numel": sum(g.hi - g.lo for g in model.groups)}  # the saving model's
    names, fetch = param_state(ckpt)
    saved_err = max(_rel(ckpt.full(f"model/{k}"), v) for k, v in ref[f"params{half}"].items() if k != "lm_head.weight")
    state_err = max(_rel(fetch(n, "exp_avg"), v) for n, v in ref[f"exp_avg{half}"].items())
    m, model, opt, _ = build(stage_to, seed=5)
    load_zero(ckpt, model, opt)
    got = train(m, model, opt, _batches()[half:])
    full = sw.full_state_dict(model)
    return {
        "zero_keys": sorted(k for k in ckpt.keys("zero/") if k.endswith("/exp_avg")),
        "zero_info": {k: (v["sbp"], v["axes"], len(v.get("pieces", []))) for k, v in ckpt.index["tensors"].items()
                      if k.startswith("zero/") and k.endswith("/exp_avg")},
        "qkv": (ckpt.index["tensors"]["model/blocks.0.attn.qkv.weight"]["sbp"],
                ckpt.index["tensors"]["model/ln_f.weight"]["sbp"]),
        "state_names": sorted(names), "ref_names": sorted(ref[f"exp_avg{half}"]),
        "save_ops": _summary(saving)["ops"], "model_written": written, **owned,
        "full_numel": sum(p.numel() for p in GPT(TINY).parameters()),  # the tied head once
        "saved_err": saved_err, "state_err": state_err,
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"][half:])),
        "param_err": max(_rel(full[k], v) for k, v in ref[f"params{STEPS}"].items()),
    }


def check_pipeline_zero1_checkpoint(root: str) -> dict[str, Any]:
    """pp 2 × dp 2 × tp 2 with ZeRO-1 (8 ranks): train, save the flat optimizer shards (one group key per pp and tp
    coordinate), read them back per parameter (vs one process's AdamW state), and load them into a fresh pipeline
    (this rank's shards come back exactly)."""
    from shardwise.checkpoint.pipeline_layout import pipeline_model_pieces
    from shardwise.checkpoint.pipeline_zero import load_pipeline_zero, pipeline_zero_groups, pipeline_zero_pieces
    from tests.dist import pipeline_hybrid_checks as hc
    from tests.dist.pipeline_checks import _batches as pipe_batches

    case = dict(axes=dict(pp=2, dp=2, tp=2), schedule="1f1b", n_layer=2, m=2, zero=1, opt="adamw")
    m, pipe = hc._build(case)
    opt = pipe.build_optimizer(hc._factory(case))
    for idx, tgt in pipe_batches():
        pipe.step(idx, tgt)
        opt.step()
        opt.zero_grad()
    pieces = pipeline_model_pieces(pipe) + pipeline_zero_pieces(pipe, opt)
    save_checkpoint(Path(root), 1, pieces, mesh=m, state={"pipeline_zero_groups": True,
                                                          "aliases": tied_aliases(pipe.model)},
                    rank_state={"zero_groups": pipeline_zero_groups(pipe)})
    ckpt = Checkpoint(Path(root))
    names, fetch = param_state(ckpt)
    model = hc._model(case["n_layer"], True)  # one process, the same steps on the whole batch
    ref_opt = hc._factory(case)(model.parameters())
    for idx, tgt in pipe_batches():
        lm_loss(model(idx), tgt).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref = {n: ref_opt.state[p]["exp_avg"] for n, p in model.named_parameters()}
    saved = {k: v for k, v in ckpt.index["tensors"].items() if k.startswith("zero/") and k.endswith("/exp_avg")}
    _, fresh = hc._build(case)
    fresh_opt = fresh.build_optimizer(hc._factory(case))
    load_pipeline_zero(ckpt, fresh, fresh_opt)
    mine = [opt.state[g.master]["exp_avg"] for g in pipe.grad_sync.groups]
    loaded = [fresh_opt.state[g.master]["exp_avg"] for g in fresh.grad_sync.groups]
    return {"keys": sorted(saved), "info": sorted({(v["sbp"], tuple(v["axes"]), len(v["pieces"])) for v in saved.values()}),
            "names_ok": sorted(names) == sorted(ref),
            "state_err": max(_rel(fetch(n, "exp_avg"), v) for n, v in ref.items()),
            "loaded_exact": all(torch.equal(a, b) for a, b in zip(mine, loaded)) and len(mine) == len(loaded)}
