"""Rank-side checks for ``sw.compile`` (run by tests/dist/test_compile.py).

Each layout trains the same GPT (same seed, same batches) for ``STEPS`` SGD steps twice — eager and with its blocks
compiled — and is compared with one process training eagerly: every step's loss, the first step's full gradients
(where the layout keeps whole per-parameter gradients) and the final parameters. The collectives of the
compiled run (op, axis, bytes, in order) must be those of the eager run.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.common.activation_checkpointing import checkpoint_layers
from shardwise.parallel.tensor.apply_plan import full_tensor, gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

TINY = dict(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32, bias=True)
BATCH, SEQ, STEPS = 4, 10, 3
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _batches(cfg: GPTConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        x = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / (1e-6 + b.double().abs().max()))


def _reference(cfg: GPTConfig) -> dict[str, Any]:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = SGD(model.parameters())
    out: dict[str, Any] = {"losses": []}
    for step, (x, y) in enumerate(_batches(cfg)):
        loss = lm_loss(model(x), y)
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def _build(layout: str, cfg: GPTConfig, ac: bool, backend: str | None) -> tuple[Any, Any, Callable, Any, int]:
    """``(step model, optimizer, loss, plain model, dp size)`` of one layout, compiled with ``backend`` (None:
    eager)."""
    torch.manual_seed(0)
    plain = GPT(cfg)
    loss: Callable = lm_loss
    if layout == "tp_sp":
        m = mesh(tp=2)
        plain = sw.parallelize(plain, m, gpt_plan(cfg, sequence_parallel=True), axis="tp", sequence_parallel=True)
        loss = functools.partial(vocab_parallel_cross_entropy, mesh=m, axis="tp")
    else:
        m = mesh(dp=2)
    if ac:
        checkpoint_layers(plain)
    if layout.startswith("zero"):
        model, opt = sw.zero(plain, m, stage=int(layout[-1]), optimizer=SGD)
    else:
        model = sw.DataParallel(plain, m, axis="dp") if layout == "dp" else plain
        opt = SGD(plain.parameters())
    if backend is not None:
        sw.compile(plain, backend=backend)
    return model, opt, loss, plain, 1 if layout == "tp_sp" else 2


def _train(layout: str, cfg: GPTConfig, ac: bool, backend: str | None) -> dict[str, Any]:
    model, opt, loss_fn, plain, dp = _build(layout, cfg, ac, backend)
    m = mesh(tp=2) if dp == 1 else mesh(dp=2)
    d, per = (m.coord("dp") if dp > 1 else 0), BATCH // dp
    out: dict[str, Any] = {"losses": [], "comm": []}
    for step, (x, y) in enumerate(_batches(cfg)):
        with CommCounter() as c:
            loss = loss_fn(model(x[d * per:(d + 1) * per]), y[d * per:(d + 1) * per])
            loss.backward()
        out["comm"].append([(r.op, r.axis, r.nbytes) for r in c.records])
        total = loss.detach().clone()
        if dp > 1:
            sw.comm.all_reduce(total, m, "dp", op="avg")
        out["losses"].append(total.item())
        if step == 0 and not layout.startswith("zero"):  # whole per-parameter gradients (tp: gathered)
            out["grads"] = {n: full_tensor(p, p.grad) for n, p in plain.named_parameters()}
        opt.step()
        opt.zero_grad()
    out["state"] = sw.full_state_dict(model)
    out["stats"] = sw.compile_stats(plain)
    return out


def check_layouts(layouts: list[tuple[str, bool, str]]) -> dict[str, Any]:
    """Per ``(layout, activation checkpointing, backend)``: the worst relative errors of the compiled run against one
    process, whether its collectives equal the eager run's, and its ``CompileStats``. Collective."""
    cfg = GPTConfig(**TINY)
    ref = _reference(cfg)
    results = {}
    for layout, ac, backend in layouts:
        eager = _train(layout, cfg, ac, None)
        comp = _train(layout, cfg, ac, backend)
        err = {"loss": max(abs(a - b) / abs(b) for a, b in zip(comp["losses"], ref["losses"])),
               "param": max(_rel(comp["state"][k], v) for k, v in ref["state"].items())}
        if "grads" in comp:
            err["grad"] = max(_rel(comp["grads"][n], g) for n, g in ref["grads"].items())
        stats = comp["stats"]
        results[f"{layout}{'+ac' if ac else ''}"] = {
            "err": err, "same_comm": comp["comm"] == eager["comm"], "n_comm": sum(map(len, eager["comm"])),
            "regions": stats.regions, "graphs": stats.graphs, "recompiles": stats.recompiles}
    return results

