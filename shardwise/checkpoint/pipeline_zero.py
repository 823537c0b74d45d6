"""Sharded save/load of ZeRO inside a pipeline (``sw.pipeline(..., dp_axis="dp", zero_stage=1|2|3)``); ZeRO-3's
model tensors: ``pipeline_zero3.py``.

Each pp coordinate has its own flat groups — the dp gradient buckets of its stages (``pipe.grad_sync.groups``),
each laying its parameters end to end in a buffer of ``L`` elements of which dp rank ``i`` owns and optimizes
``[lo, hi)``. A group's optimizer state is therefore ``S(0)`` over dp of a length-``L`` tensor, held only by that
pp coordinate: it is saved as ``zero/pp<c>.<i>/<state>`` with its SBP given over the mesh axes without pp
(``S(0)`` on dp, ``B`` on the others; scalars such as Adam's ``step`` ``B``), written once per element. With tp
inside the stages each tp coordinate's groups hold its own tp pieces: keys ``zero/pp<c>.<i>.tp<t>/<state>``,
described without tp as well (``zero_layout.py``).

No rank knows the other pp coordinates' groups, so each rank lists its own in its rank file
(``rank_state["zero_groups"]``: key, plain parameter names, element counts, shapes, extents) and the index state says
so (``"pipeline_zero_groups": true``); ``zero_layout.param_state`` reads them back as full per-parameter
tensors. So the optimizer state is layout-portable both ways: a pipeline ZeRO-1 checkpoint resumes at pp = 1,
another pp or dp, with or without ZeRO, and any checkpoint resumes into pipeline ZeRO-1 (``load_pipeline_zero``
cuts each group's flat shard from the per-parameter state). A tied parameter sits in a group on each of its
two pp coordinates; both copies' states are equal, so either serves.

Expert-parallel parameters (``parallel.ep``) are in no flat group: the inner optimizer steps them whole, and
their state is saved per parameter as every layout saves it (``optim/<name>/<state>``, ``S(0)`` over ``ep`` of
the expert mesh: ``layout.describe``), so it moves between ep sizes and layouts through the index.
"""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.pipeline.build import Pipeline
from ..parallel.pipeline.grad_sync import DpGradSync
from ..parallel.zero.optim import ZeroOptimizer
from .layout import load_optimizer, optimizer_pieces
from .pipeline_layout import load_pipeline_model
from .pipeline_zero3 import load_zero3_model
from .sharded import Checkpoint, Piece, without_axis
from .zero_layout import fill_flat_state, flat_state_pieces, group_entry, group_tag, param_state, tag_axes

__all__ = ["pipeline_zero_groups", "pipeline_zero_pieces", "load_pipeline_zero"]


def _names(pipe: Pipeline) -> dict[int, str]:
    return {id(q): n for n, q in pipe.model.named_parameters()}


def _sync(pipe: Pipeline) -> DpGradSync:
    """The pipeline's dp gradient buckets: the flat groups ZeRO-1 steps (it exists whenever ZeRO-1 does)."""
    if pipe.grad_sync is None:
        raise ValueError("pipeline has no dp gradient buckets: ZeRO-1 needs dp_axis of size > 1 and zero_stage=1")
    return pipe.grad_sync


def _keys(pipe: Pipeline) -> list[str]:
    """``pp<c>.<i>`` per group, plus ``.tp<t>`` with tensor parallelism inside (each tp coordinate's groups hold
    its own tp pieces: ``zero_layout.py``)."""
    tag = group_tag(pipe.mesh, tag_axes(pipe.mesh, _sync(pipe).axis, skip=[pipe.axis]))
    return [f"pp{pipe.mesh.coord(pipe.axis)}.{i}{tag}" for i in range(len(_sync(pipe).groups))]


def pipeline_zero_groups(pipe: Pipeline) -> list[dict[str, Any]]:
    """JSON-able description of this rank's flat groups (the same on every dp peer of its pp and tp
    coordinates): ``zero_layout.group_entry``."""
    names = _names(pipe)
    return [group_entry(key, g, [names[id(q)] for q in g.params], pipe.mesh)
            for key, g in zip(_keys(pipe), _sync(pipe).groups)]


def pipeline_zero_pieces(pipe: Pipeline, optimizer: ZeroOptimizer) -> list[Piece]:
    """This rank's flat optimizer-state shards (``S(0)`` over dp of each group's length-L state), described
    without the pp axis (and the tp axis, which the key names), and the expert parameters' own state. Local."""
    dp = _sync(pipe).axis
    drop = [pipe.axis, *tag_axes(pipe.mesh, dp, skip=[pipe.axis])]
    flat = [piece for key, g in zip(_keys(pipe), _sync(pipe).groups)
            for piece in flat_state_pieces(key, g, optimizer.optimizer.state.get(g.master, {}), pipe.mesh, dp, drop)]
    experts = [without_axis(piece, pipe.axis) for piece in optimizer_pieces(pipe.model, _Experts(pipe, optimizer),  # type: ignore[arg-type]
                                                                            pipe.mesh)]
    return flat + experts


class _Experts:
    """The expert parameters' slice of ZeRO-1's inner optimizer (its ``state`` dict itself): what
    ``layout.optimizer_pieces`` / ``load_optimizer`` read and fill."""

    def __init__(self, pipe: Pipeline, optimizer: ZeroOptimizer) -> None:
        self.param_groups = [{"params": pipe.expert_params()}]
        self.state = optimizer.optimizer.state


@torch.no_grad()
def load_pipeline_zero(ckpt: Checkpoint, pipe: Pipeline, optimizer: ZeroOptimizer) -> None:
    """Load this rank's stage tensors and rebuild its flat optimizer-state shards from a checkpoint of any
    layout (per-parameter state, ZeRO groups, or another pipeline's groups). Local (file reads)."""
    if pipe.zero3 is not None or pipe.mixed_precision is not None:  # into each rank's shards (fp32 masters)
        load_zero3_model(ckpt, pipe)
    else:
        load_pipeline_model(ckpt, pipe)  # the parameters are views of the groups' full buffers: copied in place
    saved, fetch = param_state(ckpt)
    names = _names(pipe)
    groups = _sync(pipe).groups
    fill_flat_state(optimizer.optimizer, groups, [[names[id(q)] for q in g.params] for g in groups], saved, fetch)
    if pipe.expert_params():
        load_optimizer(ckpt, pipe.model, _Experts(pipe, optimizer), pipe.mesh)  # type: ignore[arg-type]
