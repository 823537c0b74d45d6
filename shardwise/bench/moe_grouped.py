"""Part (a) of ``shardwise bench moe``: one MoE block's forward and backward with its experts as one grouped
matmul (``F.grouped_mm``, ``GroupedExperts.impl = "grouped"``) against one matmul per expert (``"loop"``), in
this process, at several expert counts with the tokens, hidden and expert widths fixed.

A third row, ``loop-indexed``, is the per-expert loop as transformers' experts module writes it: each expert's
weight indexed (``w[e]``), whose backward writes a full (E, ., .) zero gradient per expert and adds them up
(quadratic in the expert count). The model's own loop (``"loop"``) unbinds the weights once (``unbind(0)``: its
backward stacks the per-expert gradients once), so it stays linear.

Every implementation runs the same block (same weights, same input, same output gradient): the router, the
token permutation and the weighted sum are shared, only the expert matmuls differ. Rounds interleave the two,
so a machine that slows down mid-run slows both; the speed-up is the median over rounds of
``loop ms / grouped ms`` in the same round. The outputs and every gradient are compared (``max_rel_diff``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.moe import MoE, MoESettings, grouped_mm_available

__all__ = ["measure_grouped", "grouped_rows"]

IMPLS = ("loop", "loop-indexed", "grouped")


def _block(n_experts: int, top_k: int, hidden: int, ffn: int) -> MoE:
    """A block with every weight drawn from the same seed (the router's scale keeps the choices spread)."""
    torch.manual_seed(0)
    block = MoE(MoESettings(n_experts=n_experts, top_k=top_k, hidden=hidden, ffn=ffn))
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block


def _indexed_experts(experts: torch.nn.Module, x: Tensor, counts: list[int]) -> Tensor:
    """``GroupedExperts.forward`` as a loop over indexed weights: ``x`` (M, h) grouped by expert → (M, h)."""
    gate_up, down = experts.gate_up_proj, experts.down_proj
    outs = []
    for e, piece in enumerate(torch.split(x, counts, dim=0)):
        gate, up = (piece @ gate_up[e].t()).chunk(2, dim=-1)
        outs.append((F.silu(gate) * up) @ down[e].t())
    return torch.cat(outs, dim=0)


def _use(block: MoE, impl: str) -> None:
    """Point the block's experts at ``impl`` (an instance attribute: the class default stays as it is)."""
    experts = block.experts
    experts.__dict__.pop("forward", None)
    if impl == "loop-indexed":
        experts.forward = lambda x, counts: _indexed_experts(experts, x, counts)
        experts.impl = "loop"
    else:
        experts.impl = impl


def _fwd_bwd(block: MoE, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One forward and backward; the output and the gradients (input first, then the parameters)."""
    block.zero_grad(set_to_none=True)
    x.grad = None
    y = block(x)
    y.backward(grad)
    return y.detach(), [x.grad] + [p.grad for p in block.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _one_shape(n_experts: int, tokens: int, top_k: int, hidden: int, ffn: int, *, warmup: int, steps: int,
               repeats: int) -> dict[str, Any]:
    block = _block(n_experts, top_k, hidden, ffn)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, hidden, generator=gen).requires_grad_(True)  # (b, t, h) with b = 1
    grad = torch.randn(1, tokens, hidden, generator=gen)
    results = {}
    for impl in IMPLS:
        _use(block, impl)
        results[impl] = _fwd_bwd(block, x, grad)
    diff = max(max([_rel(results[impl][0], results["loop"][0])]
                   + [_rel(g, r) for g, r in zip(results[impl][1], results["loop"][1])]) for impl in IMPLS[1:])
    times: dict[str, list[list[float]]] = {impl: [] for impl in IMPLS}
    for impl in IMPLS:
        _use(block, impl)
        for _ in range(warmup):
            _fwd_bwd(block, x, grad)
    for _ in range(repeats):
        for impl in IMPLS:
            _use(block, impl)
            one = []
            for _ in range(steps):
                t = time.perf_counter()
                _fwd_bwd(block, x, grad)
                one.append(time.perf_counter() - t)
            times[impl].append(one)
    ms = {impl: 1e3 * statistics.median(t for r in times[impl] for t in r) for impl in IMPLS}
    speedup = {base: statistics.median(statistics.median(lo) / statistics.median(gr)
                                       for lo, gr in zip(times[base], times["grouped"])) for base in IMPLS[:2]}
    w = block.experts.gate_up_proj
    return {"experts": n_experts, "tokens": tokens, "top_k": top_k, "hidden": hidden, "ffn": ffn,
            "rows_per_expert": tokens * top_k / n_experts, "loop_ms": ms["loop"], "loop_indexed_ms": ms["loop-indexed"],
            "grouped_ms": ms["grouped"], "speedup": speedup["loop"], "speedup_vs_indexed": speedup["loop-indexed"],
            "max_rel_diff": diff,
            "grouped_mm": grouped_mm_available(x.detach().view(-1, hidden), w.detach())}


def measure_grouped(experts: list[int], *, tokens: int, top_k: int, hidden: int, ffn: int, warmup: int = 2,
                    steps: int = 3, repeats: int = 5) -> list[dict[str, Any]]:
    """One row per expert count: median fwd+bwd ms of each implementation, the paired speed-ups of grouped over
    loop and over loop-indexed, the largest relative difference of outputs and gradients to the loop's, whether ``F.grouped_mm`` ran (else both loop)."""
    return [_one_shape(e, tokens, top_k, hidden, ffn, warmup=warmup, steps=steps, repeats=repeats) for e in experts]


def grouped_rows(rows: list[dict[str, Any]], threads: int) -> str:
    """The table printed for part (a)."""
    head = (f"(a) one MoE block, forward + backward, {rows[0]['tokens']} tokens, top_k {rows[0]['top_k']}, "
            f"hidden {rows[0]['hidden']}, expert width {rows[0]['ffn']}, {threads} threads")
    lines = [head, f"{'experts':>8}{'rows/exp':>10}{'loop ms':>10}{'indexed ms':>11}{'grouped ms':>12}"
                   f"{'vs loop':>9}{'vs indexed':>11}{'rel diff':>10}"]
    for r in rows:
        note = "" if r["grouped_mm"] else "  (grouped_mm unavailable: all loop)"
        lines.append(f"{r['experts']:>8}{r['rows_per_expert']:>10.0f}{r['loop_ms']:>10.1f}{r['loop_indexed_ms']:>11.1f}"
                     f"{r['grouped_ms']:>12.1f}{r['speedup']:>8.2f}x{r['speedup_vs_indexed']:>10.2f}x"
                     f"{r['max_rel_diff']:>10.1e}{note}")
    return "\n".join(lines)
