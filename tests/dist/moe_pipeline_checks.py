"""Rank-side checks of expert parallelism inside a pipeline at the library level (run by
tests/dist/test_moe_pipeline.py): a GPT whose two blocks are MoE layers, its experts cut over an ``ep`` axis
folded into each stage's dp ranks (``shard_experts`` on an expert mesh ``(pp, edp, ep)`` with the pipeline
mesh's rank order), run by ``sw.pipeline`` over pp with dp inside. Dense gradients average in the pipeline's dp
buckets, expert gradients in ``ExpertGradSync`` after the step's last pass; every block's balancing-loss weight
is the share of the step's loss one micro-batch pass carries, ``1 / (microbatches · accum)``.

Reference: the same model on one process over the whole batch (same seed, same data), computed on every rank.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.models.moe_balance import dp_reducer, set_grad_scale, step_stats, update_bias
from shardwise.parallel.expert.grads import ExpertGradSync
from shardwise.parallel.expert.shard import shard_experts
from tests.dist.meshes import mesh

STEPS, B, T = 2, 8, 16


def _config(**kw: Any) -> GPTConfig:
    base = dict(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32, n_experts=4, top_k=2, moe_ffn=32,
                n_shared_experts=1, moe_aux_loss_coef=0.05)
    return GPTConfig(**{**base, **kw})  # type: ignore[arg-type]


def _data(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _factory() -> Any:
    # eps 1e-4: near-zero gradients (the biases that start at 0) otherwise amplify summation-order noise
    return partial(torch.optim.AdamW, lr=1e-2, eps=1e-4)


def _reference(cfg: GPTConfig, clip: float = 0.0) -> tuple[list[float], GPT, list[float]]:
    """One process, whole batch: one backward of the batch's mean loss (balancing loss weight 1); ``clip``: the
    gradient norm clipped to it (and returned per step)."""
    torch.manual_seed(0)
    ref = GPT(cfg)
    opt = _factory()(ref.parameters())
    losses, norms = [], []
    for s in range(STEPS):
        x, y = _data(s, cfg.vocab_size)
        loss = lm_loss(ref(x), y)
        loss.backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_bias(ref)
        step_stats(ref)
        losses.append(loss.item())
    return losses, ref, norms


def _pipe(case: dict, cfg: GPTConfig) -> tuple[Any, Any, nn.Module, int]:
    pp, dp, ep = case["pp"], case["dp"], case["ep"]
    m = mesh(pp=pp, dp=dp)
    em = mesh(pp=pp, edp=dp // ep, ep=ep)  # dp = (edp, ep), ep inner: the same ranks in the same order
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    shard_experts(model, em, "ep")
    accum = case.get("accum", 1)
    pipe = sw.pipeline(model, m, "pp", microbatches=case["m"], schedule=case["schedule"],
                       loss_fn=lambda out, y: lm_loss(out, y) / accum, chunks=case.get("chunks", 1), dp_axis="dp",
                       zero_stage=case.get("zero", 0))
    set_grad_scale(model, 1.0 / (case["m"] * accum))  # the pipeline weighs each micro-batch's loss 1 / m
    return m, em, model, pipe


def run_case(case: dict) -> dict:
    """Train ``case`` (pp, dp, ep, schedule, m, accum, chunks, zero, model fields) for STEPS AdamW steps; the max
    relative error of this rank's parameters and balancing biases against the one-process reference, the
    losses, and how many expert parameters the dp buckets hold (must be 0)."""
    cfg = _config(**case.get("model", {}))
    m, em, model, pipe = _pipe(case, cfg)
    opt = pipe.build_optimizer(_factory())
    experts = ExpertGradSync(pipe.expert_params(), em, "edp", m.size("dp"))
    local = nn.ModuleList(pipe.stages.values())  # the blocks this rank runs (the others are released)
    reduce = dp_reducer(m, "dp")
    accum, losses, norms = case.get("accum", 1), [], []
    for s in range(STEPS):
        x, y = _data(s, cfg.vocab_size)
        with sw.comm.CommCounter() as counter:
            losses.append(sum(pipe.step(xa, ya) for xa, ya in zip(x.chunk(accum), y.chunk(accum))))
        experts.sync()
        if case.get("clip"):  # each expert piece counted once (on the first rank holding it), scaled everywhere
            norms.append(float(pipe.clip_grad_norm_(case["clip"])))
        opt.step()
        opt.zero_grad(set_to_none=True)
        update_bias(local, reduce)
        step_stats(local, reduce)
    ref_losses, ref, ref_norms = _reference(cfg, case.get("clip", 0.0))
    in_buckets = sum(1 for g in (pipe.grad_sync.groups if pipe.grad_sync else []) for q in g.params
                     if getattr(q, "_shardwise_expert", None) is not None)
    return {"err": _param_err(pipe, ref, em), "losses": losses, "ref": ref_losses, "in_buckets": in_buckets,
            "norms": norms, "ref_norms": ref_norms,
            "n_experts": len(pipe.expert_params()), "a2a": counter.count("all_to_all", axis="ep")}


def _param_err(pipe: Any, ref: GPT, em: sw.Mesh) -> float:
    """Max relative error of this rank's stage parameters and buffers (an expert weight against its rows)."""
    full = ref.state_dict()  # a tied weight under each of its keys
    err = 0.0
    for stage in pipe.stages.values():
        params = {id(q) for q in stage.parameters()}
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            key = name.replace("parts.", "", 1).replace("/", ".")
            want = full[key]
            if t.dim() == 3 and t.size(0) != want.size(0):
                c = em.coord("ep")
                want = want[c * t.size(0):(c + 1) * t.size(0)]
            # parameters relative to their largest entry; buffers (the balancing bias: multiples of the rate) absolute
            scale = want.abs().max().clamp_min(1e-12) if id(t) in params else 1.0
            err = max(err, float((t.detach().float() - want.float()).abs().max() / scale))
    return err


def aux_matters(case: dict, factor: float) -> float:
    """Negative control on one process: the largest relative change of a router weight after STEPS steps when
    the balancing loss's weight is multiplied by ``factor`` (0: a lost balancing-loss gradient; 2: the weight
    ``1 / m`` instead of ``1 / (m · accum)`` with accum 2). Parity at 1e-5 can only see such a bug if this is large."""
    kw = case.get("model", {})
    coef = _config(**kw).moe_aux_loss_coef
    _, right, _ = _reference(_config(**kw))
    _, wrong, _ = _reference(_config(**{**kw, "moe_aux_loss_coef": coef * factor}))
    other = dict(wrong.named_parameters())
    with torch.no_grad():
        return max(float((q - other[n]).abs().max() / q.abs().max()) for n, q in right.named_parameters()
                   if n.endswith("gate.weight"))
