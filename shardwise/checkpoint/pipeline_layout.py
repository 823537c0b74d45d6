"""Sharded save/load for a model run by ``sw.pipeline``: each rank writes only its own stages' tensors.

A pipeline rank holds only the tensors of its stages; the other pp coordinates hold other tensors. So a stage
tensor is not a ``B`` or ``S`` of the pp axis: its ``Piece`` is described on the mesh *without* the pp axis —
``B`` over dp, and over tp whatever tensor parallelism inside the stage made it (``S(d)`` shards, head-split
QKV), exactly as ``layout.describe`` gives it — and only ranks of the pp coordinate that owns it emit it, so
every element is written once (dp coordinate 0 of that pp coordinate, each tp shard by its tp coordinate).
A tensor held by stages on two pp coordinates (the GPT's tied ``wte.weight`` / ``lm_head.weight``) is owned by
the lower one, so it is written once, under its first ``state_dict`` key, as every layout writes it (the alias
goes into the index state).

Keys are the plain model's (``model/<key>``, ``optim/<parameter name>/<state>``), so a pp checkpoint loads in
any layout (pp = 1, other pp, dp, tp, ZeRO) and ``shardwise export`` reads it unchanged; loading into a
pipeline reads only this rank's stage tensors and their optimizer state, from a checkpoint of any layout.
ZeRO-1 inside a pipeline (flat optimizer-state shards per pp coordinate): ``pipeline_zero.py``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel.pipeline.build import Pipeline
from .layout import describe, load_optimizer, optimizer_pieces, tied_aliases
from .sharded import Checkpoint, Piece, without_axis

__all__ = ["key_owners", "without_axis", "pipeline_model_pieces", "pipeline_optimizer_pieces", "load_pipeline_model",
           "load_pipeline"]


def key_owners(pipe: Pipeline) -> dict[str, int]:
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


def _mine(pipe: Pipeline) -> set[str]:
    me = pipe.mesh.coord(pipe.axis)
    return {key for key, owner in key_owners(pipe).items() if owner == me}


def pipeline_model_pieces(pipe: Pipeline) -> list[Piece]:
    """This rank's stage tensors (the keys its pp coordinate owns) as pieces over the axes without pp. Local."""
    mine = _mine(pipe)
    # describe() reads the layout attributes (tp spec, head split) of the tensor itself; the piece holds an alias
    return [without_axis(describe(f"model/{k}", v, pipe.mesh, v.detach()), pipe.axis)
            for k, v in pipe.model.state_dict(keep_vars=True).items() if k in mine]


def pipeline_optimizer_pieces(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> list[Piece]:
    """This rank's optimizer state for the parameters its pp coordinate owns, under the plain parameter names
    (``named_parameters`` lists a tied parameter under its first key, which is also its state_dict key); state
    shaped like its parameter shares the parameter's tp layout. Local."""
    mine = _mine(pipe)
    out = []
    for piece in optimizer_pieces(pipe.model, optimizer, pipe.mesh):
        name = piece.key[len("optim/"):].rpartition("/")[0]
        if name in mine:  # else the tied copy of the higher pp coordinate: its twin (identical state) is saved
            out.append(without_axis(piece, pipe.axis))
    return out


def _stage_keys(pipe: Pipeline) -> list[str]:
    """State-dict keys of the modules this rank's stages run (a tied weight under each of its keys)."""
    names = [n for stage in pipe.stages.values() for n in stage.owned_names()]
    return [k for k in pipe.model.state_dict() if any(k.startswith(n + ".") for n in names)]


@torch.no_grad()
def load_pipeline_model(ckpt: Checkpoint, pipe: Pipeline) -> None:
    """Load this rank's stage tensors (its tp piece of each) from a checkpoint of any layout. Local (reads
    files only): every checkpoint stores each storage whole under its first key, so a tied alias reads that."""
    model: nn.Module = pipe.model
    first = tied_aliases(model)  # {alias key: first key} of this model
    tensors = model.state_dict(keep_vars=True)
    for key in _stage_keys(pipe):
        if key in ckpt.omitted:  # a frozen parameter left out (frozen.py): the stage holds its pretrained value
            continue
        value = tensors[key]
        target = describe(f"model/{first.get(key, key)}", value, pipe.mesh, value.detach())
        value.copy_(ckpt.load_piece(target).to(value.device, value.dtype))


def load_pipeline(ckpt: Checkpoint, pipe: Pipeline, optimizer: torch.optim.Optimizer) -> None:
    """Load this rank's stage tensors and their optimizer state (per-parameter optimizer; for ZeRO-1 see
    ``pipeline_zero.load_pipeline_zero``) from a checkpoint of any layout. Local (file reads)."""
    load_pipeline_model(ckpt, pipe)
    # The optimizer holds this rank's stage parameters only; their state has the parameters' layout.
    load_optimizer(ckpt, pipe.model, optimizer, pipe.mesh)
