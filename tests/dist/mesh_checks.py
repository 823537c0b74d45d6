"""Rank-side checks for Mesh, the harness and the differentiable collectives."""

from __future__ import annotations

import os
import time

import torch

import shardwise as sw
from shardwise.comm import autograd as ag
from shardwise.comm import shard_sizes
from tests.dist.meshes import mesh


def mesh_facts() -> dict:
    m = mesh(dp=2, tp=2)
    sub = m.sub("tp")
    return {"rank": m.rank, "coords": (m.coord("dp"), m.coord("tp")), "shape": m.shape, "axes": m.axes,
            "tp_ranks": m.ranks("tp"), "dp_ranks": m.ranks("dp"), "sub_axes": sub.axes,
            "sub_coord": sub.coord("tp"), "sub_size": sub.size("tp"), "device": str(m.device),
            "repr": repr(m)}


def raise_on_rank(bad: int) -> int:
    if sw.Mesh(dp=-1).rank == bad:
        raise RuntimeError(f"boom from rank {bad}")
    return 0


def hang_on_rank(bad: int) -> int:
    m = mesh(dp=-1)
    if m.rank == bad:
        time.sleep(600)
    return os.getpid()


def _reference_grads(fn_single, x_full: torch.Tensor, w: torch.Tensor):
    x = x_full.clone().requires_grad_(True)
    out = fn_single(x)
    (out * w).sum().backward()
    return out.detach(), x.grad


def check_autograd_pairs() -> list[str]:
    """Each pair's forward and backward equal the single-device computation it stands for."""
    m = mesh(dp=-1)
    n, r = m.size("dp"), m.coord("dp")
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2 * n + 1, 5, generator=g)      # the logical tensor
    weight = torch.randn(2 * n + 1, 5, generator=g)    # d(loss)/d(out) pattern
    sizes = shard_sizes(full.shape[0], n)
    mine = torch.split(full, sizes)[r]
    my_w = torch.split(weight, sizes)[r]
    failures = []

    # split_allgather: B -> S. Loss on each rank uses its slice; summed over ranks it is the full loss.
    x = full.clone().requires_grad_(True)
    (ag.split_allgather(x, m, "dp", dim=0) * my_w).sum().backward()
    if not torch.allclose(x.grad, weight):  # every rank gets the gradient of the full loss
        failures.append("split_allgather")

    # allgather_split: S -> B with a replicated downstream loss: grad of the shard = my slice of it.
    x = mine.clone().requires_grad_(True)
    y = ag.allgather_split(x, m, "dp", dim=0, sizes=sizes)
    (y * weight).sum().backward()
    if not torch.equal(y.detach(), full) or not torch.allclose(x.grad, my_w):
        failures.append("allgather_split")

    # allgather_reducescatter: each rank's loss is a *part* (1/n scaled by rank weight) of the total.
    x = mine.clone().requires_grad_(True)
    y = ag.allgather_reducescatter(x, m, "dp", dim=0, sizes=sizes)
    ((y * weight) * (r + 1)).sum().backward()  # total loss = sum_r (r+1) * <y, weight>
    if not torch.allclose(x.grad, my_w * sum(range(1, n + 1))):
        failures.append("allgather_reducescatter")

    # reducescatter_allgather: P -> S; logical value = sum of partials; grad of each partial = full grad.
    part = full * (r + 1)
    x = part.clone().requires_grad_(True)
    y = ag.reducescatter_allgather(x, m, "dp", dim=0)
    (y * my_w).sum().backward()
    if not torch.allclose(y.detach(), mine * sum(range(1, n + 1)), atol=1e-5) or not torch.allclose(x.grad, weight):
        failures.append("reducescatter_allgather")

    # allreduce_identity: P -> B; each rank's loss uses the full sum; grad to each partial is identity.
    x = part.clone().requires_grad_(True)
    y = ag.allreduce_identity(x, m, "dp")
    (y * weight).sum().backward()
    if not torch.allclose(y.detach(), full * sum(range(1, n + 1)), atol=1e-5) or not torch.allclose(x.grad, weight):
        failures.append("allreduce_identity")

    # identity_allreduce: replicated input feeding rank-local partial losses; grad = sum over ranks.
    x = full.clone().requires_grad_(True)
    (ag.identity_allreduce(x, m, "dp") * weight * (r + 1)).sum().backward()
    if not torch.allclose(x.grad, weight * sum(range(1, n + 1)), atol=1e-5):
        failures.append("identity_allreduce")
    return failures
