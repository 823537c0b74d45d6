"""The model tensors of ZeRO-3 inside a pipeline (``sw.pipeline(..., zero_stage=3)``): saved and loaded from shards.

Each unit's parameters are at most two flat groups sharded over dp, its trainable and its frozen ones
(``parallel/pipeline/zero3.py``); between steps no rank holds a whole parameter of either. Frozen shards are saved
as the trainable ones are (and dropped by name, like any frozen piece, under ``train.save_frozen = false``:
``checkpoint/frozen.py``); a load that finds them left out keeps the values the shards were built with. Without
tensor parallelism inside the stages every rank writes the elements of its own shard as ranges of the flattened
parameters (``RangePiece``, described on the mesh without pp: ``S(0)`` over dp) — nothing is gathered, and a
checkpoint holds each parameter whole under its plain key, as every layout writes it.
With tp inside, each unit is gathered over dp for the save (its tp pieces are what ``layout.describe`` knows how to
place): the save then holds this rank's stages whole for a moment. A tensor tied to another pp coordinate is
written by the lower one (``pipeline_layout.key_owners``). Loading gathers every unit, reads the tensors as any
pipeline does and copies each rank's range back into its shard. The optimizer state: ``pipeline_zero.py``, as for
ZeRO-1 and 2 (the flat groups are the same objects).
"""

from __future__ import annotations

import contextlib

import torch

from ..parallel.pipeline.build import Pipeline
from ..parallel.pipeline.zero3 import PipelineStage3
from ..parallel.zero.flat import FlatGroup
from ..sbp.placement import Replicate, Split
from .layout import describe, tied_aliases
from .pipeline_layout import load_pipeline_model, pipeline_model_pieces, without_axis
from .pipeline_layout import key_owners
from .sharded import Checkpoint, Piece, RangePiece
from .zero_layout import tag_axes

__all__ = ["zero3_model_pieces", "load_zero3_model"]


def _value_groups(pipe: Pipeline) -> list[FlatGroup]:
    """Every flat group holding this rank's parameter values: the dp gradient buckets, then ZeRO-3's frozen ones."""
    frozen = pipe.zero3.frozen_groups if pipe.zero3 is not None else []
    return [*pipe.grad_sync.groups, *frozen]  # type: ignore[union-attr]


def _runtime(pipe: Pipeline) -> PipelineStage3:
    assert pipe.zero3 is not None, "the gathered path needs ZeRO-3 (shardwise train refuses bf16-mixed with pp x tp)"
    return pipe.zero3


def zero3_model_pieces(pipe: Pipeline) -> list[Piece]:
    """This rank's model pieces (see module doc): ZeRO-3's, and under mixed precision any ZeRO stage's (the fp32
    masters are the weights). Without tp: local. With tp (ZeRO-3): collective over dp."""
    assert pipe.grad_sync is not None, "ZeRO pipelines only"
    dp = pipe.grad_sync.axis
    if tag_axes(pipe.mesh, dp, skip=[pipe.axis]):
        with _runtime(pipe).gathered():  # the pieces must outlive the gather: copies
            return [Piece(p.key, p.local.clone(), p.view_shape, p.full_shape, p.sbp, p.axes, p.mesh_shape, p.coords)
                    for p in pipeline_model_pieces(pipe)]
    me = pipe.mesh.coord(pipe.axis)
    mine = {k for k, owner in key_owners(pipe).items() if owner == me}
    names = {id(q): n for n, q in pipe.model.named_parameters()}
    axes = tuple(a for a in pipe.mesh.axes if a != pipe.axis)
    sbp = tuple(Split(0) if a == dp else Replicate() for a in axes)
    shape, coords = tuple(pipe.mesh.size(a) for a in axes), tuple(pipe.mesh.coord(a) for a in axes)
    out: list[Piece] = []
    managed: set[int] = set()
    for g in _value_groups(pipe):
        managed |= {id(q) for q in g.params}
        master = g.master.detach()
        for k, a, b in g.layout.pieces(pipe.mesh.coord(dp)):
            name = names[id(g.params[k])]
            if name not in mine:  # the tied copy of the higher pp coordinate: its twin is written
                continue
            start = g.layout.offsets[k] + a - g.lo  # in this rank's shard
            out.append(RangePiece(f"model/{name}", master[start:start + b - a], (g.layout.numels[k],),
                                  tuple(g.shapes[k]), sbp, axes, shape, coords, rows=(a, b - a)))
    # buffers, expert parameters and frozen ones of another dtype: whole, as any pipeline writes them
    tensors = pipe.model.state_dict(keep_vars=True)
    out += [without_axis(describe(f"model/{k}", v, pipe.mesh, v.detach()), pipe.axis)
            for k, v in tensors.items() if k in mine and id(v) not in managed]
    return out


@torch.no_grad()
def load_zero3_model(ckpt: Checkpoint, pipe: Pipeline) -> None:
    """Load this rank's stage tensors into its shards, from a checkpoint of any layout. ZeRO-3: collective over dp
    (each unit is gathered while its values are read). Mixed precision (any stage): the saved fp32 values go into
    the masters, not through the bf16 parameters."""
    zero3 = pipe.zero3
    with zero3.gathered() if zero3 is not None else contextlib.nullcontext():
        load_pipeline_model(ckpt, pipe)  # every tensor of the stages (bf16 under mixed precision)
        if pipe.mixed_precision is not None:
            _load_masters(ckpt, pipe)
        elif zero3 is not None:
            zero3.sync_shards()


def _load_masters(ckpt: Checkpoint, pipe: Pipeline) -> None:
    """Each flat group from the checkpoint's values at full precision (``FlatGroup.load_full``); a group the
    checkpoint left out entirely (a frozen base, ``train.save_frozen = false``) keeps its values. Local."""
    names = {id(q): n for n, q in pipe.model.named_parameters()}
    first = tied_aliases(pipe.model)
    for g in _value_groups(pipe):
        if all(names[id(q)] in ckpt.omitted for q in g.params):
            continue
        values = [ckpt.load_piece(describe(f"model/{first.get(names[id(q)], names[id(q)])}", q, pipe.mesh,
                                           q.detach())) for q in g.params]
        g.load_full(values)
