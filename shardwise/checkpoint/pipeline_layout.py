"""Sharded save/load for a model run by ``sw.pipeline``: each rank writes only its own stages' tensors.

A pipeline rank holds whole tensors, but only those of its stages; the other pp coordinates hold other
tensors. So a stage tensor is not a ``B`` or ``S`` of the pp axis: its ``Piece`` is described on the mesh
*without* the pp axis (``B`` over dp and tp), and only ranks of the pp coordinate that owns it emit it — dp
(and tp) coordinate 0 of that pp coordinate writes it, once. A tensor held by stages on two pp coordinates
(the GPT's tied ``wte.weight`` / ``lm_head.weight``) is owned by the lower one, so it is written once, under
its first ``state_dict`` key, as every layout writes it (the alias goes into the index state).

Keys are the plain model's (``model/<key>``, ``optim/<parameter name>/<state>``), so a pp checkpoint loads in
any layout (pp = 1, other pp, dp, tp, ZeRO) and ``shardwise export`` reads it unchanged; loading into a
pipeline reads only this rank's stage tensors and their optimizer state, from a checkpoint of any layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mesh import Mesh
from ..sbp.placement import Broadcast
from .layout import load_optimizer, tied_aliases
from .sharded import Checkpoint, Piece, replicated_piece

__all__ = ["key_owners", "pipeline_model_pieces", "pipeline_optimizer_pieces", "load_pipeline"]


def key_owners(pipe: Any) -> dict[str, int]:
    """``{state_dict key: pp coordinate that saves it}`` for every key of the whole model, each storage once
    (a tied weight under its first key, owned by the lowest pp coordinate whose stages use it). Pure."""
    p = pipe.mesh.size(pipe.axis)
    module_owner: dict[str, int] = {}
    for stage in pipe.all_stages:  # stage order, so a module run by two stages keeps the first one's rank
        for name in stage.owned_names():
            module_owner.setdefault(name, stage.index % p)
    owners: dict[str, int] = {}
    users: dict[int, set[int]] = {}  # storage id -> pp coordinates whose modules hold it
    first: dict[int, str] = {}
    for key, value in pipe.model.state_dict(keep_vars=True).items():
        module = max((n for n in module_owner if key.startswith(n + ".")), key=len)
        users.setdefault(id(value), set()).add(module_owner[module])
        first.setdefault(id(value), key)
    for storage, key in first.items():
        owners[key] = min(users[storage])
    return owners


def _stage_piece(key: str, t: torch.Tensor, mesh: Mesh, axis: str) -> Piece:
    """``t`` whole on this rank, replicated over every mesh axis except the pipeline axis (see module doc)."""
    axes = tuple(a for a in mesh.axes if a != axis)
    shape = tuple(t.shape)
    return Piece(key, t, shape, shape, tuple(Broadcast() for _ in axes), axes, tuple(mesh.size(a) for a in axes),
                 tuple(mesh.coord(a) for a in axes))


def _mine(pipe: Any) -> set[str]:
    me = pipe.mesh.coord(pipe.axis)
    return {key for key, owner in key_owners(pipe).items() if owner == me}


def pipeline_model_pieces(pipe: Any) -> list[Piece]:
    """This rank's stage tensors (the keys its pp coordinate owns) as pieces. Local."""
    mine = _mine(pipe)
    return [_stage_piece(f"model/{k}", v.detach(), pipe.mesh, pipe.axis)
            for k, v in pipe.model.state_dict(keep_vars=True).items() if k in mine]


def pipeline_optimizer_pieces(pipe: Any, optimizer: torch.optim.Optimizer) -> list[Piece]:
    """This rank's optimizer state for the parameters its pp coordinate owns, under the plain parameter names
    (``named_parameters`` lists a tied parameter under its first key, which is also its state_dict key). Local."""
    mine = _mine(pipe)
    names = {id(q): n for n, q in pipe.model.named_parameters()}
    out: list[Piece] = []
    for group in optimizer.param_groups:
        for q in group["params"]:
            if names[id(q)] not in mine:
                continue  # the tied copy of the higher pp coordinate: its twin (identical state) is saved
            for state, value in optimizer.state.get(q, {}).items():
                value = value if isinstance(value, torch.Tensor) else torch.tensor(value)
                out.append(_stage_piece(f"optim/{names[id(q)]}/{state}", value.detach(), pipe.mesh, pipe.axis))
    return out


def _stage_keys(pipe: Any) -> list[str]:
    """State-dict keys of the modules this rank's stages run (a tied weight under each of its keys)."""
    names = [n for stage in pipe.stages.values() for n in stage.owned_names()]
    return [k for k in pipe.model.state_dict() if any(k.startswith(n + ".") for n in names)]


@torch.no_grad()
def load_pipeline(ckpt: Checkpoint, pipe: Any, optimizer: torch.optim.Optimizer) -> None:
    """Load this rank's stage tensors and their optimizer state from a checkpoint of any layout. Local (reads
    files only): every checkpoint stores each storage whole under its first key, so a tied alias reads that."""
    model: nn.Module = pipe.model
    first = tied_aliases(model)  # {alias key: first key} of this model
    tensors = model.state_dict(keep_vars=True)
    for key in _stage_keys(pipe):
        value = tensors[key]
        target = replicated_piece(f"model/{first.get(key, key)}", value.detach(), pipe.mesh)
        value.copy_(ckpt.load_piece(target).to(value.device, value.dtype))
    # The optimizer holds this rank's stage parameters only; their state is whole on this rank (B everywhere).
    load_optimizer(ckpt, model, optimizer, pipe.mesh)
