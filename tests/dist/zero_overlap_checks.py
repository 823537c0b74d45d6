"""Rank-side checks for ZeRO stages 1-2 reducing during backward (run by tests/dist/test_zero_overlap.py).

The model is a chain of four ``Linear`` layers of odd sizes: backward produces l3's gradients first and l0's
last, and autograd runs a leaf's gradient accumulation as soon as its gradient exists, so the order in which
buckets complete is fixed. With the caps below the buckets are (reverse registration order, a bucket closes
at >= its cap: 100 B for the first, 200 B after), in fp32 bytes of their parameters:

    [l3.bias 3 + l3.weight 33 = 36 el] = 144 B    (>= 100: closes)
    [l2.bias 11 + l2.weight 99 = 110 el] = 440 B  (>= 200: closes)
    [l1.bias 9 + l1.weight 63 = 72 el] = 288 B
    [l0.bias 7 + l0.weight 35 = 42 el] = 168 B    (the rest)

so the first three reduce-scatters must already have been issued when l0's first gradient arrives, the
fourth before ``backward()`` returns, and none at the step. With the unused parameters (``spare``: 90 el,
between l1 and l2; ``never``: 8 el, registered first) the buckets are 144, 440, [spare] 360, 288 and
[l0 + never] 200 B; buckets start strictly in order, so while ``spare`` has no gradient (a micro-batch that
skips it) its bucket and every later one wait for the end of backward. Parity runs compare with one process training the
same weights on the whole batch (AdamW with weight decay, clipping), with unused parameters (``spare`` used
on some micro-batches only, ``never`` never: ZeRO steps them with a zero gradient, so the reference fills a
missing gradient with zeros), and with accumulation (no_sync, and two synchronised backwards before a step).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.comm import CommCounter
from tests.dist.meshes import mesh

CAPS = dict(first_bucket_mb=100 / 2**20, bucket_cap_mb=200 / 2**20)
BUCKET_BYTES = [144, 440, 288, 168]  # see the module docstring
BUCKET_BYTES_UNUSED = [144, 440, 360, 288, 200]
GLOBAL_B, STEPS = 12, 4
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-5, weight_decay=0.1)
CLIP = 0.5
# micro-batch u of a step: ("local" = inside no_sync, "sync" = a synchronised backward)
PLANS = {"plain": ["sync"], "serial": ["sync"], "native": ["sync"], "shm": ["sync"], "accum": ["local", "local", "sync"],
         "accum-sync": ["local", "sync", "sync"]}


class Chain(nn.Module):
    """l0..l3 in sequence; with ``unused``: ``never`` (registered first, in l0's bucket) takes no part in any
    loss, ``spare`` (between l1 and l2) only when ``use_spare`` is set."""

    def __init__(self, unused: bool) -> None:
        super().__init__()
        if unused:
            self.never = nn.Linear(3, 2)
        self.l0, self.l1 = nn.Linear(5, 7), nn.Linear(7, 9)
        if unused:
            self.spare = nn.Linear(9, 9)
        self.l2, self.l3 = nn.Linear(9, 11), nn.Linear(11, 3)
        self.use_spare = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        if self.use_spare:
            h = h + torch.tanh(self.spare(h))
        return self.l3(torch.tanh(self.l2(h)))


def _build(unused: bool) -> Chain:
    torch.manual_seed(0)
    return Chain(unused)


def _batch(step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(GLOBAL_B, 5, generator=g), torch.randn(GLOBAL_B, 3, generator=g)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def _spare_on(step: int, micro: int) -> bool:
    return (step + micro) % 2 == 1


def _reference(unused: bool, plan: list[str]) -> tuple[Chain, list[float], list[float]]:
    """One process, whole batch; a parameter without a gradient steps with zeros (as ZeRO's flat shards)."""
    model = _build(unused)
    opt = ADAMW(model.parameters())
    losses, norms = [], []
    for s in range(STEPS):
        for u in range(len(plan)):
            model.use_spare = unused and _spare_on(s, u)
            loss = _loss(model, *_batch(s, u))
            loss.backward()
            losses.append(float(loss))
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        opt.zero_grad()
    return model, losses, norms


def _rs_bytes(counter: CommCounter) -> list[int]:
    return [r.nbytes for r in counter.records if r.op == "reduce_scatter"]


def _algorithms(counter: CommCounter) -> list[str]:
    return sorted({r.algorithm for r in counter.records if r.op in ("reduce_scatter", "all_gather")})  # ZeRO's collectives


def _train(stage: int, unused: bool, plan: list[str], overlap: bool, **kw: Any) -> dict[str, Any]:
    m = mesh(dp=-1)
    n, i = m.size("dp"), m.coord("dp")
    model, opt = sw.zero(_build(unused), m, stage=stage, optimizer=ADAMW, overlap=overlap, **CAPS, **kw)
    chain: Chain = model.module  # type: ignore[assignment]
    snaps: list[list[int]] = []
    live: list[CommCounter] = []

    def snapshot(_p: torch.Tensor) -> None:  # l0's gradients are the last of a backward
        if live:
            snaps.append(_rs_bytes(live[0]))
    for p in (chain.l0.weight, chain.l0.bias):
        p.register_post_accumulate_grad_hook(snapshot)
    losses, norms, phases = [], [], []
    per = GLOBAL_B // n
    for s in range(STEPS):
        for u, kind in enumerate(plan):
            chain.use_spare = unused and _spare_on(s, u)
            x, y = (t[i * per:(i + 1) * per] for t in _batch(s, u))
            snaps.clear()
            with (model.no_sync() if kind == "local" else _Null()):
                loss = _loss(model, x, y)
                with CommCounter() as cb:
                    live[:] = [cb]
                    loss.backward()
                    live.clear()
            mean = loss.detach().clone()
            sw.comm.all_reduce(mean, m, "dp", op="avg")
            losses.append(float(mean))
            phases.append({"kind": kind, "at_l0": snaps[0] if snaps else None, "backward": _rs_bytes(cb),
                           "spare": chain.use_spare, "algorithms": _algorithms(cb)})
        with CommCounter() as cs:
            norms.append(float(opt.clip_grad_norm_(CLIP)))
            opt.step()
        phases.append({"kind": "step", "ops": cs.by_op(), "algorithms": _algorithms(cs)})
    return {"state": sw.full_state_dict(model), "losses": losses, "norms": norms, "phases": phases}


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: Any) -> None:
        return None


def _rel(a: float, b: float) -> float:
    return abs(a - b) / (1e-6 + abs(b))


def check_overlap(configs: list[tuple[int, str, bool]]) -> list[dict[str, Any]]:
    """``(stage, variant, unused)``: parity with one process (params, losses, clip norms) and the recorded
    reduce-scatters of every backward and step. Collective."""
    out = []
    for stage, variant, unused in configs:
        plan = PLANS[variant]
        ref, ref_losses, ref_norms = _reference(unused, plan)
        kw = {"algorithm": variant} if variant in ("native", "shm") else {}
        got = _train(stage, unused, plan, overlap=variant != "serial", **kw)
        err = max(float((got["state"][k] - v).abs().max()) / (1e-3 + float(v.abs().max()))
                  for k, v in ref.state_dict().items())
        out.append({"cfg": (stage, variant, unused), "err": err, "phases": got["phases"],
                    "loss_err": max(_rel(a, b) for a, b in zip(got["losses"], ref_losses)),
                    "norm_err": max(_rel(a, b) for a, b in zip(got["norms"], ref_norms)),
                    "keys_ok": sorted(got["state"]) == sorted(ref.state_dict())})
    return out
