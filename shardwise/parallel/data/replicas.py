"""Keeping data-parallel replicas equal: input checks, a cross-rank signature check, coalesced broadcast and
averaging of many tensors.

Replicas that differ in parameter names, shapes or order would otherwise pair the wrong tensors in every
all-reduce (garbage) or disagree on message sizes (a hang). ``check_replicas_agree`` compares a fixed-size
signature with one all-gather, which cannot hang on the mismatch it detects, and raises ``ValueError`` on
every rank naming the first difference.
"""

from __future__ import annotations

import zlib
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from ... import comm
from ...mesh import Mesh
from ..common.expert_tag import is_expert_param
from ..common.materialize import source_of

__all__ = ["check_module", "check_replicas_agree", "broadcast_coalesced", "average_coalesced", "trainable"]


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter that requires grad, each shared Parameter once (by identity,
    first name wins: ``named_parameters`` already deduplicates tied weights). Expert-parallel pieces are not
    replicas (each rank holds other experts): they are left to ``parallel/expert/grads.py``."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and not is_expert_param(p)]


def check_module(module: object, mesh: Mesh, axis: str) -> None:
    """Local checks (no communication): a module, not already wrapped, on the mesh's device, with floating
    trainable parameters. Raises ``TypeError``/``ValueError`` naming the offending tensor."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected an nn.Module to wrap, got {type(module).__name__}")
    if getattr(module, "_shardwise_data_parallel", False):
        raise ValueError(f"{type(module).__name__} is already wrapped for data parallelism (or is a wrapper); "
                         f"wrap the plain model once")
    if isinstance(module, nn.parallel.DistributedDataParallel):
        raise ValueError("the module is a torch DistributedDataParallel; pass its .module instead")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a shardwise.Mesh, got {type(mesh).__name__}")
    mesh.size(axis)  # raises ValueError for an unknown axis
    params = trainable(module)
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameter with requires_grad=True (every parameter is "
                         f"frozen): there is nothing to train or synchronise; unfreeze what should train "
                         f"(p.requires_grad_(True)) before wrapping, or run the model without a wrapper")
    for name, p in params:
        if not p.is_floating_point():
            raise TypeError(f"parameter {name!r} has dtype {p.dtype} and requires grad; data parallelism "
                            f"averages floating gradients only: make it a buffer or set requires_grad=False")
    want = mesh.device
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        if t.is_meta:  # built on the meta device: the wrapper materialises it on the mesh's device
            continue
        if t.device.type != want.type or (want.index is not None and t.device.index != want.index):
            raise ValueError(f"tensor {name!r} is on {t.device} but this rank's mesh device is {want}; "
                             f"move the whole model there first (model.to({str(want)!r}))")


def _describe(module: nn.Module) -> list[str]:
    """One line per parameter/buffer: what every replica must agree on."""
    rows = [f"param {n} {tuple(p.shape)} {p.dtype} grad={p.requires_grad}{_seed(p)}" for n, p in module.named_parameters()]
    return rows + [f"buffer {n} {tuple(b.shape)} {b.dtype}" for n, b in module.named_buffers()]


def _seed(t: torch.Tensor) -> str:
    """A meta tensor's source seed (replicas that materialise it must draw the same values)."""
    seed = getattr(source_of(t), "seed", None) if t.is_meta else None
    return "" if seed is None else f" seed={seed}"


def check_replicas_agree(module: nn.Module, mesh: Mesh, axis: str) -> None:
    """Collective over ``axis``: raise ``ValueError`` on every rank unless all replicas have the same
    parameters and buffers (names, shapes, dtypes, order). One fixed-size all-gather; on a mismatch, one
    more (object) all-gather to name the first difference."""
    rows = _describe(module)
    mine = torch.tensor([len(rows), zlib.crc32("\n".join(rows).encode()) & 0x7FFFFFFF], dtype=torch.int64)
    n = mesh.size(axis)
    mine = mine.to(mesh.device)
    gathered = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(gathered, mine, group=mesh.group(axis))
    table = torch.stack(gathered).cpu()
    if len(set(map(tuple, table.tolist()))) == 1:
        return
    every: list[list[str] | None] = [None] * n
    dist.all_gather_object(every, rows, group=mesh.group(axis))
    ranks = mesh.ranks(axis)
    first = next(k for k in range(max(len(r) for r in every if r is not None))
                 if len({(r[k] if r is not None and k < len(r) else "<missing>") for r in every}) > 1)
    detail = "; ".join(f"rank {ranks[j]}: {r[first] if r is not None and first < len(r) else '<missing>'}"
                       for j, r in enumerate(every))
    counts = ", ".join(f"rank {ranks[j]}: {len(r or [])}" for j, r in enumerate(every))
    raise ValueError(f"replicas along axis {axis!r} differ at parameter/buffer #{first} ({detail}); tensor "
                     f"counts ({counts}). Every rank must build the same model (same code, config and "
                     f"registration order) before wrapping it")


def _groups(tensors: Iterable[torch.Tensor]) -> dict[tuple[torch.dtype, torch.device], list[torch.Tensor]]:
    out: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault((t.dtype, t.device), []).append(t)
    return out


@torch.no_grad()
def broadcast_coalesced(tensors: Sequence[torch.Tensor], mesh: Mesh, axis: str, *, src: int = 0) -> None:
    """Copy the tensors of coordinate ``src`` into every rank's tensors, in place: one broadcast per
    (dtype, device) group of a flat concatenation. Collective over ``axis``."""
    for group in _groups(t for t in tensors if t.numel() > 0).values():
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.broadcast(flat, mesh, axis, src=src)
        _scatter_back(flat, group)


@torch.no_grad()
def average_coalesced(tensors: Sequence[torch.Tensor], mesh: Mesh, axis: str, *, algorithm: str = "native") -> None:
    """Replace every (floating) tensor by its mean over ``axis``, in place: one all-reduce per (dtype,
    device) group. Collective over ``axis``."""
    for (dtype, _), group in _groups(t for t in tensors if t.numel() > 0).items():
        if not dtype.is_floating_point:
            raise TypeError(f"cannot average tensors of dtype {dtype}; only floating tensors are averaged")
        flat = torch.cat([t.reshape(-1) for t in group])
        comm.all_reduce(flat, mesh, axis, op="avg", algorithm=algorithm)
        _scatter_back(flat, group)


def _scatter_back(flat: torch.Tensor, group: Sequence[torch.Tensor]) -> None:
    pos = 0
    for t in group:
        t.copy_(flat[pos:pos + t.numel()].view(t.shape))
        pos += t.numel()
