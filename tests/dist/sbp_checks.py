"""Rank-side checks for global tensors and boxing (run by tests/dist/test_sbp.py)."""

from __future__ import annotations

import itertools
import math

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.sbp import Replicate, Partial, Split, format_sbp
from shardwise.sbp.spec import local_extent
from tests.dist.meshes import mesh

SHAPE = (9, 5)  # 4k+1 rows and a column count indivisible by 2, 3, 4: uneven everywhere
PLACEMENTS = [Split(0), Split(1), Replicate(), Partial("sum"), Partial("max")]


def _ints(seed: int, shape) -> torch.Tensor:
    return torch.randint(-8, 9, tuple(shape), generator=torch.Generator().manual_seed(seed)).float()


def make_local(full: torch.Tensor, m: sw.Mesh, sbp) -> torch.Tensor:
    """This rank's local tensor for ``full`` under ``sbp``, built independently of the boxing code: the
    extent for S axes, then the piece split into integer partials over the P axes."""
    coords = [m.coord(a) for a in m.axes]
    piece = full[tuple(slice(s, s + n) for s, n in local_extent(full.shape, sbp, m.shape, coords))].clone()
    p_axes = [i for i, p in enumerate(sbp) if isinstance(p, Partial)]
    if not p_axes:
        return piece
    sizes = [m.shape[i] for i in p_axes]
    mine = sum(coords[i] * math.prod(sizes[j + 1:]) for j, i in enumerate(p_axes))
    others = [_ints(1000 + k, piece.shape) for k in range(1, math.prod(sizes))]
    if sbp[p_axes[0]].op == "max":
        return piece if mine == 0 else piece - others[mine - 1].abs() - 1
    return piece - sum(others, torch.zeros_like(piece)) if mine == 0 else others[mine - 1]


def check_all_pairs(axes: dict, with_max: bool) -> list[str]:
    m = mesh(**axes)
    full = _ints(0, SHAPE)
    weight = _ints(1, SHAPE)
    places = PLACEMENTS if with_max else PLACEMENTS[:4]
    sigs = [s for s in itertools.product(places, repeat=len(m.axes))
            if len({p.op for p in s if isinstance(p, Partial)}) <= 1]
    failures = []
    coords = [m.coord(a) for a in m.axes]
    for src, dst in itertools.product(sigs, repeat=2):
        name = f"[{format_sbp(src)}] -> [{format_sbp(dst)}]"
        leaf = make_local(full, m, src).requires_grad_(True)
        x = sw.to_global(leaf, m, src, shape=SHAPE)
        y = x.to_sbp(dst)
        if y.sbp != tuple(dst) or tuple(y.to_local().shape) != y.spec.local_shape(coords):
            failures.append(f"{name}: spec {y.spec} local {tuple(y.to_local().shape)}")
            continue
        if not torch.equal(y.to_local().detach(), make_local(full, m, dst)) and not any(
                isinstance(p, Partial) for p in dst):
            failures.append(f"{name}: local piece differs")
        got = y.full()
        if not torch.equal(got.detach(), full):
            failures.append(f"{name}: value changed")
            continue
        if any(p == Partial("max") for p in src):
            continue  # the gradient of a max-partial goes to its argmax; values were checked
        (got * weight).sum().backward()
        want = make_local(weight, m, [p if isinstance(p, Split) else Replicate() for p in src])
        if not torch.equal(leaf.grad, want):
            failures.append(f"{name}: gradient differs")
    return failures


def count_pattern(src: str, dst: str) -> dict:
    m = mesh(dp=-1)
    full = _ints(0, SHAPE)
    x = sw.to_global(make_local(full, m, sw.parse_sbp(src)), m, src, shape=SHAPE)
    with CommCounter() as c:
        x.to_sbp(dst)
    return c.by_op()


def bad_input(case: str) -> str:
    m = mesh(dp=-1)
    calls = {
        "dim": lambda: sw.distribute(torch.ones(2, 2), m, [Split(2)]),
        "length": lambda: sw.distribute(torch.ones(2, 2), m, [Split(0), Replicate()]),
        "local_shape": lambda: sw.to_global(torch.ones(3, 2), m, "S(0)", shape=(3 * m.size("dp") + 5, 2)),
        "parse": lambda: sw.parse_sbp("S(0),X"),
    }
    try:
        calls[case]()
    except (ValueError, TypeError) as exc:
        return str(exc)
    return "no error"
