"""Sharded save/load for models wrapped by ``sw.zero``: optimizer state lives on flat shards.

A ZeRO flat group lays its parameters end to end in one buffer of ``L`` elements; each dp rank owns the slice
``shard_sizes(L, N)`` gives it, which is exactly ``S(0)`` of a length-``L`` tensor over the dp axis. So the
per-group optimizer state is saved as ``zero/<group>/<state>`` with SBP ``S(0)`` (``B`` on other axes), and
the groups' parameter names and sizes go into the index state (ZeRO-1 inside a pipeline: groups per pp
coordinate, listed in the rank files, ``pipeline_zero.py``). Loading converts in both directions through
full per-parameter tensors (``param_state``): ZeRO ↔ plain data/tensor parallelism, any stage, any dp size.
Parameters are saved through the wrapper's ``full_state_dict()`` (collective) and loaded with its
``load_state_dict`` (full tensors, any stage).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..mesh import Mesh
from ..parallel.zero.api import ZeroModel
from ..parallel.zero.flat import FlatGroup
from ..parallel.zero.optim import ZeroOptimizer
from ..sbp.placement import Broadcast, Split
from .sharded import Checkpoint, Piece, replicated_piece

__all__ = ["zero_model_pieces", "zero_optimizer_pieces", "zero_groups_state", "param_state", "fill_flat_state",
           "load_zero"]


def zero_model_pieces(model: ZeroModel, mesh: Mesh) -> list[Piece]:
    """Full parameters (collective: ``full_state_dict``), saved as replicated tensors, each storage once."""
    seen: set[int] = set()
    out: list[Piece] = []
    for key, value in model.full_state_dict().items():
        if id(value) not in seen:
            seen.add(id(value))
            out.append(replicated_piece(f"model/{key}", value, mesh))
    return out


def zero_optimizer_pieces(model: ZeroModel, optimizer: ZeroOptimizer, mesh: Mesh, axis: str = "dp") -> list[Piece]:
    """This rank's flat optimizer-state shards as ``S(0)`` pieces of each group's length-L state. Local."""
    coords = tuple(mesh.coord(a) for a in mesh.axes)
    sbp = tuple(Split(0) if a == axis else Broadcast() for a in mesh.axes)
    out: list[Piece] = []
    for i, g in enumerate(model.groups):
        for name, value in optimizer.optimizer.state.get(g.master, {}).items():
            key = f"zero/{i}/{name}"
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == g.hi - g.lo:
                total = (g.layout.total,)
                out.append(Piece(key, value.detach(), total, total, sbp, tuple(mesh.axes), tuple(mesh.shape), coords))
            else:
                out.append(replicated_piece(key, torch.as_tensor(value).detach(), mesh))
    return out


def zero_groups_state(model: ZeroModel) -> list[dict[str, Any]]:
    """JSON-able description of the flat groups (names, element counts, shapes), for the index."""
    return [{"names": list(g.names), "numels": list(g.layout.numels), "shapes": [list(s) for s in g.shapes]}
            for g in model.groups]


def _saved_groups(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """The checkpoint's flat groups, each with its ``key`` (``zero/<key>/<state>``): ``sw.zero``'s from the index
    state (key = position), a pipeline's from every rank file (``pipeline_zero.py``; each key once)."""
    groups = [dict(g, key=g.get("key", str(i))) for i, g in enumerate(ckpt.state.get("zero_groups") or [])]
    if ckpt.state.get("pipeline_zero_groups"):
        seen: dict[str, dict[str, Any]] = {}
        for rank in range(int(ckpt.index["world_size"])):
            for g in (ckpt.rank_state(rank) or {}).get("zero_groups", []):
                seen.setdefault(g["key"], g)
        groups += list(seen.values())
    return groups


def param_state(ckpt: Checkpoint) -> tuple[dict[str, list[str]], Callable[[str, str], torch.Tensor]]:
    """``(state names per parameter, fetch(param, state) -> full tensor)`` from either checkpoint format:
    per-parameter ``optim/<param>/<state>`` or ZeRO ``zero/<group>/<state>`` flat groups."""
    names: dict[str, list[str]] = {}
    for key in ckpt.keys("optim/"):
        param, _, state = key[len("optim/"):].rpartition("/")
        names.setdefault(param, []).append(state)
    where: dict[str, tuple[str, int, int, list[int]]] = {}
    for g in _saved_groups(ckpt):
        states = sorted({k.rpartition("/")[2] for k in ckpt.keys(f"zero/{g['key']}/")})
        offset = 0
        for n, numel, shape in zip(g["names"], g["numels"], g["shapes"]):
            names[n], where[n] = states, (g["key"], offset, numel, shape)
            offset += numel
    cache: dict[str, torch.Tensor] = {}

    def fetch(param: str, state: str) -> torch.Tensor:
        if param not in where:
            return ckpt.full(f"optim/{param}/{state}")
        group, offset, numel, shape = where[param]
        key = f"zero/{group}/{state}"
        if key not in cache:
            cache[key] = ckpt.full(key)
        flat = cache[key]
        return flat[offset:offset + numel].reshape(shape) if flat.dim() == 1 and flat.numel() > 1 else flat
    return names, fetch


@torch.no_grad()
def fill_flat_state(inner: torch.optim.Optimizer, groups: Sequence[FlatGroup], group_names: list[list[str]],
                    saved: dict[str, list[str]], fetch: Callable[[str, str], torch.Tensor]) -> None:
    """Set ``inner``'s state of each flat group's ``master`` (this rank's ``[lo, hi)`` shard) from full
    per-parameter state (``param_state``); ``group_names``: the plain parameter names of each group. Local."""
    for g, names in zip(groups, group_names):
        new: dict[str, torch.Tensor] = {}
        for state in saved.get(names[0], []):
            values = [fetch(n, state) for n in names]
            if values[0].dim() == 0:  # e.g. Adam's step: one scalar per group
                new[state] = values[0].clone()
            else:
                flat = torch.cat([v.reshape(-1) for v in values])
                new[state] = flat[g.lo:g.hi].to(g.master.device, g.master.dtype).clone()
        if new:
            inner.state[g.master] = new


@torch.no_grad()
def load_zero(ckpt: Checkpoint, model: ZeroModel, optimizer: ZeroOptimizer) -> None:
    """Load parameters (full, any stage) and rebuild this rank's flat optimizer-state shards. Local."""
    plain: nn.Module = model.module
    aliases = ckpt.state.get("aliases", {})
    full = {}
    for key in plain.state_dict().keys():
        full[key] = ckpt.full(f"model/{aliases.get(key, key)}")
    model.load_state_dict(full)
    names, fetch = param_state(ckpt)
    fill_flat_state(optimizer.optimizer, model.groups, [list(g.names) for g in model.groups], names, fetch)
