"""Rank-side checks: torch ops on global tensors equal the single-device computation (values and grads)."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.sbp import Replicate
from tests.dist.meshes import mesh

B, T, H, V = 4, 5, 8, 11  # batch, sequence, hidden, vocabulary


def _leaves(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(B, T, H, generator=g), "w1": torch.randn(2 * H, H, generator=g) / 3,
            "b1": torch.randn(2 * H, generator=g), "w2": torch.randn(H, 2 * H, generator=g) / 3,
            "b2": torch.randn(H, generator=g), "ln_w": torch.randn(H, generator=g), "ln_b": torch.randn(H, generator=g),
            "head": torch.randn(V, H, generator=g) / 3, "y": torch.randint(0, V, (B * T,), generator=g)}


def _forward(t: dict, flat: bool):
    """The same program for plain tensors and global tensors: MLP, residual, layer norm, head, CE loss."""
    h = F.gelu(F.linear(t["x"], t["w1"], t["b1"]))
    h = F.linear(h, t["w2"], t["b2"]) + t["x"]
    h = F.layer_norm(h, (H,), t["ln_w"], t["ln_b"])
    logits = F.linear(h, t["head"]).reshape(B * T, V)
    attn = torch.softmax(torch.matmul(h, h.transpose(1, 2)) * 0.1, -1).mean()
    return F.cross_entropy(logits, t["y"]) + attn


def check_program(axes: dict, layout: dict) -> list[str]:
    """``layout`` maps leaf name -> SBP string; the loss and every leaf gradient must match one device."""
    m = mesh(**axes)
    ref = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in _leaves(0).items()}
    ref_loss = _forward(ref, True)
    ref_loss.backward()
    leaves = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in _leaves(0).items()}
    glob = {k: sw.distribute(v, m, layout.get(k, ",".join(["B"] * len(m.axes)))) for k, v in leaves.items()}
    loss = _forward(glob, False).to_sbp([Replicate()] * len(m.axes))
    loss.backward()
    failures = []
    if not torch.allclose(loss.to_local(), ref_loss.detach(), rtol=1e-5, atol=1e-6):
        failures.append(f"loss {loss.to_local().item()} vs {ref_loss.item()}")
    for k, v in leaves.items():
        if v.is_floating_point() and not torch.allclose(v.grad, ref[k].grad, rtol=1e-4, atol=1e-6):
            failures.append(f"grad {k} max err {(v.grad - ref[k].grad).abs().max().item():.2e}")
    return failures


def missing_rule() -> str:
    m = mesh(dp=-1)
    x = sw.distribute(torch.ones(4, 4), m, "S(0)")
    try:
        torch.cumsum(x, 0)
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


def different_meshes() -> str:
    a = sw.distribute(torch.ones(4, 4), mesh(dp=-1), "S(0)")
    b = sw.distribute(torch.ones(4, 4), mesh(debug=True, dp=-1), "S(0)")
    try:
        a + b
    except ValueError as exc:
        return str(exc)
    return "no error"


def op_overhead(iters: int = 2000) -> tuple[float, float]:
    """(µs per local 64x64 add, µs per global-tensor add of the same shards) — used by the benchmark."""
    m = mesh(dp=-1)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    ga, gb = sw.to_global(a, m, "S(0)"), sw.to_global(b, m, "S(0)")
    for _ in range(10):
        ga + gb
    t0 = time.perf_counter()
    for _ in range(iters):
        a + b
    t1 = time.perf_counter()
    for _ in range(iters):
        ga + gb
    t2 = time.perf_counter()
    return (t1 - t0) / iters * 1e6, (t2 - t1) / iters * 1e6
