"""Rank-side checks for sequence-parallel gradient regions (run by tests/dist/test_sp_grad_regions.py).

Every consumer of ``.grad`` must see the tp-summed gradient of the replicated parameters (norms, row biases,
``wpe``) even though it is summed by one all-reduce per region: AdamW + clipping, gradient accumulation (with
data parallelism's ``no_sync``), activation checkpointing (non-reentrant and reentrant), dp × tp, ZeRO 1-3.
The reference is one process training the same GPT (same seed) on the same full batches.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.common.activation_checkpointing import checkpoint_layers
from shardwise.parallel.common.grad_norm import clip_counted, counted
from shardwise.parallel.tensor.apply_plan import full_tensor, gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

TINY = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True)
BATCH, SEQ, STEPS, CLIP = 4, 10, 3, 0.05
# eps 1e-5: AdamW's m/sqrt(v) of near-zero gradients (key biases) amplifies float summation-order noise
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5, weight_decay=0.1)


def _batches(cfg: GPTConfig, accum: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``STEPS`` steps of ``accum`` micro-batches of (BATCH, SEQ) token ids and targets."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        pieces = []
        for _ in range(accum):
            x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
            pieces.append((x[:, :-1], x[:, 1:]))
        out.append(pieces)
    return out


def _reference(cfg: GPTConfig, batches) -> dict[str, Any]:
    """One process: per step the losses of the micro-batches, the full gradients before clipping, the clip
    norm; the final state."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = ADAMW(model.parameters())
    out: dict[str, Any] = {"losses": [], "grads": [], "norms": []}
    for pieces in batches:
        for x, y in pieces:
            loss = lm_loss(model(x), y) / len(pieces)
            loss.backward()
            out["losses"].append(loss.item())
        out["grads"].append({n: p.grad.clone() for n, p in model.named_parameters()})
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _reentrant(model: torch.nn.Module) -> None:
    """Checkpoint every block with torch's reentrant form (forward without grad, recompute + nested backward)."""
    for block in model.blocks:
        block.forward = functools.partial(checkpoint, type(block).forward, block, use_reentrant=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / (1e-6 + b.double().abs().max()))


def check_parity(axes: dict[str, int], ckpt: str = "none", accum: int = 1, cfg_kw: dict | None = None,
                 algorithm: str = "native") -> dict:
    """Train the SP model (``ckpt``: "none" | "layers" (checkpoint_layers, non-reentrant) | "reentrant");
    with a dp axis it is wrapped by ``sw.DataParallel`` and all but the last micro-batch run under ``no_sync``.
    Returns the worst relative errors against one process and, per backward, the tp all-reduces (bytes)."""
    m = mesh(**axes)
    cfg = GPTConfig(**{**TINY, **(cfg_kw or {})})
    batches = _batches(cfg, accum)
    ref = _reference(cfg, batches)
    torch.manual_seed(0)
    tp_model = sw.parallelize(GPT(cfg), m, gpt_plan(cfg, sequence_parallel=True), axis="tp", sequence_parallel=True,
                              algorithm=algorithm)
    if ckpt == "layers":
        checkpoint_layers(tp_model)
    elif ckpt == "reentrant":
        _reentrant(tp_model)
    dp = m.size("dp") if "dp" in m.axes else 1
    model = sw.DataParallel(tp_model, m, axis="dp") if dp > 1 else tp_model
    params = list(tp_model.named_parameters())
    opt = ADAMW([p for _, p in params])
    d, per = (m.coord("dp") if dp > 1 else 0), BATCH // dp
    err = {"loss": 0.0, "grad": 0.0, "norm": 0.0}
    backwards: list[list[int]] = []
    ran: set[str] = set()  # the implementations the tp collectives of every forward and backward ran with
    k = 0
    for step, pieces in enumerate(batches):
        for i, (x, y) in enumerate(pieces):
            sync = dp == 1 or i == len(pieces) - 1
            with model.no_sync() if not sync else contextlib.nullcontext():
                with CommCounter() as fwd:
                    loss = vocab_parallel_cross_entropy(model(x[d * per:(d + 1) * per]), y[d * per:(d + 1) * per],
                                                        mesh=m, axis="tp", algorithm=algorithm) / len(pieces)
                with CommCounter() as c:
                    loss.backward()
            backwards.append([r.nbytes for r in c.records if r.axis == "tp" and r.op == "all_reduce"])
            ran.update(r.algorithm for r in fwd.records + c.records if r.axis == "tp")
            total = loss.detach().clone()
            if dp > 1:
                sw.comm.all_reduce(total, m, "dp", op="avg")
            err["loss"] = max(err["loss"], abs(total.item() - ref["losses"][k]) / abs(ref["losses"][k]))
            k += 1
        for n, p in params:  # collective over tp (the sharded ones): every rank walks the same list
            err["grad"] = max(err["grad"], _rel(full_tensor(p, p.grad), ref["grads"][step][n]))
        count = [p.grad for _, p in params if counted(p, m, set(), set())]  # replicas once (tp coord 0, dp 0)
        norm = clip_counted(count, [p.grad for _, p in params], mesh=m, max_norm=CLIP, norm_type=2.0)
        err["norm"] = max(err["norm"], abs(float(norm) - ref["norms"][step]) / ref["norms"][step])
        opt.step()
        opt.zero_grad()
    full = sw.full_state_dict(tp_model)
    err["param"] = max(_rel(full[key], v) for key, v in ref["state"].items())
    return {"err": err, "backwards": backwards, "ref_norms": ref["norms"], "algorithms": sorted(ran)}


def check_zero_parity(stage: int, units: list[list[str]] | None = None) -> dict:
    """ZeRO ``stage`` over dp with SP tensor parallelism inside on a (dp=2, tp=2) mesh: AdamW + ZeRO's
    clipping vs one process; per backward the tp all-reduces (bytes). ``units``: stage-3 units."""
    m = mesh(dp=2, tp=2)
    cfg = GPTConfig(**TINY)
    batches = _batches(cfg, 1)
    ref = _reference(cfg, batches)
    torch.manual_seed(0)
    tp_model = sw.parallelize(GPT(cfg), m, gpt_plan(cfg, sequence_parallel=True), axis="tp", sequence_parallel=True)
    kw = {} if units is None else {"units": units}
    model, opt = sw.zero(tp_model, m, stage=stage, optimizer=ADAMW, **kw)
    d, per = m.coord("dp"), BATCH // 2
    err = {"loss": 0.0, "norm": 0.0}
    backwards = []
    for step, ((x, y),) in enumerate(batches):
        loss = vocab_parallel_cross_entropy(model(x[d * per:(d + 1) * per]), y[d * per:(d + 1) * per],
                                            mesh=m, axis="tp")
        with CommCounter() as c:
            loss.backward()
        backwards.append([r.nbytes for r in c.records if r.axis == "tp" and r.op == "all_reduce"])
        total = loss.detach().clone()
        sw.comm.all_reduce(total, m, "dp", op="avg")
        err["loss"] = max(err["loss"], abs(total.item() - ref["losses"][step]) / abs(ref["losses"][step]))
        norm = float(opt.clip_grad_norm_(CLIP))
        err["norm"] = max(err["norm"], abs(norm - ref["norms"][step]) / ref["norms"][step])
        opt.step()
        opt.zero_grad()
    full = sw.full_state_dict(model)
    err["param"] = max(_rel(full[key], v) for key, v in ref["state"].items())
    return {"err": err, "backwards": backwards, "ref_norms": ref["norms"]}


def check_swaps_restored() -> dict:
    """The region names, and that every module holds its own ``nn.Parameter`` objects again after a
    forward + backward, after a forward without grad, and after a forward that raised inside ln_1 (its
    parameters swapped out then)."""
    m = mesh(tp=2)
    cfg = GPTConfig(**TINY)
    torch.manual_seed(0)
    model = sw.parallelize(GPT(cfg), m, gpt_plan(cfg, sequence_parallel=True), axis="tp", sequence_parallel=True)
    before = {n: (mod, dict(mod._parameters)) for n, mod in model.named_modules()}

    def intact() -> bool:
        return all(mod._parameters[k] is p and isinstance(p, torch.nn.Parameter)
                   for mod, params in before.values() for k, p in params.items() if p is not None)

    x, y = _batches(cfg, 1)[0][0]
    out = {"regions": [r.name for r in model._shardwise_tensor_parallel.regions]}
    vocab_parallel_cross_entropy(model(x), y, mesh=m, axis="tp").backward()
    out["after_backward"] = intact()
    with torch.no_grad():
        model(x)
    out["after_no_grad"] = intact()

    def boom(*_: object) -> None:
        raise RuntimeError("boom")
    ln_1 = model.blocks[0].ln_1
    ln_1.forward = boom  # raises inside ln_1's forward, while its parameters are swapped out
    try:
        model(x)
    except RuntimeError as e:
        out["raised"] = str(e)
    del ln_1.forward
    out["after_raise"] = intact()
    return out
