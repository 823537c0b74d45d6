"""Sharded save/load of ZeRO-1 inside a pipeline (``sw.pipeline(..., dp_axis="dp", zero_stage=1)``).

Each pp coordinate has its own flat groups — the dp gradient buckets of its stages (``pipe.grad_sync.groups``),
each laying its parameters end to end in a buffer of ``L`` elements of which dp rank ``i`` owns and optimizes
``[lo, hi)``. A group's optimizer state is therefore ``S(0)`` over dp of a length-``L`` tensor, held only by that
pp coordinate: it is saved as ``zero/pp<c>.<i>/<state>`` with its SBP given over the mesh axes without pp
(``S(0)`` on dp, ``B`` on the others; scalars such as Adam's ``step`` ``B``), written once per element.

No rank knows the other pp coordinates' groups, so each rank lists its own in its rank file
(``rank_state["zero_groups"]``: key, plain parameter names, element counts, shapes) and the index state says
so (``"pipeline_zero_groups": true``); ``zero_layout.param_state`` reads them back as full per-parameter
tensors. So the optimizer state is layout-portable both ways: a pipeline ZeRO-1 checkpoint resumes at pp = 1,
another pp or dp, with or without ZeRO, and any checkpoint resumes into pipeline ZeRO-1 (``load_pipeline_zero``
cuts each group's flat shard from the per-parameter state). A tied parameter sits in a group on each of its
two pp coordinates; both copies' states are equal, so either serves.
"""

from __future__ import annotations

from typing import Any

import torch

from ..parallel.pipeline.api import Pipeline
from ..parallel.pipeline.grad_sync import DpGradSync
from ..parallel.zero.optim import ZeroOptimizer
from ..sbp.placement import Broadcast, Split
from .pipeline_layout import load_pipeline_model, without_axis
from .sharded import Checkpoint, Piece
from .zero_layout import fill_flat_state, param_state

__all__ = ["pipeline_zero_groups", "pipeline_zero_pieces", "load_pipeline_zero"]


def _names(pipe: Pipeline) -> dict[int, str]:
    return {id(q): n for n, q in pipe.model.named_parameters()}


def _sync(pipe: Pipeline) -> DpGradSync:
    """The pipeline's dp gradient buckets: the flat groups ZeRO-1 steps (it exists whenever ZeRO-1 does)."""
    if pipe.grad_sync is None:
        raise ValueError("pipeline has no dp gradient buckets: ZeRO-1 needs dp_axis of size > 1 and zero_stage=1")
    return pipe.grad_sync


def _key(pipe: Pipeline, i: int) -> str:
    return f"pp{pipe.mesh.coord(pipe.axis)}.{i}"


def pipeline_zero_groups(pipe: Pipeline) -> list[dict[str, Any]]:
    """JSON-able description of this rank's flat groups (the same on every dp/tp peer of its pp coordinate)."""
    names = _names(pipe)
    return [{"key": _key(pipe, i), "names": [names[id(q)] for q in g.params], "numels": list(g.layout.numels),
             "shapes": [list(s) for s in g.shapes]} for i, g in enumerate(_sync(pipe).groups)]


def pipeline_zero_pieces(pipe: Pipeline, optimizer: ZeroOptimizer) -> list[Piece]:
    """This rank's flat optimizer-state shards (``S(0)`` over dp of each group's length-L state). Local."""
    mesh, dp = pipe.mesh, _sync(pipe).axis
    coords = tuple(mesh.coord(a) for a in mesh.axes)
    sbp = tuple(Split(0) if a == dp else Broadcast() for a in mesh.axes)
    out: list[Piece] = []
    for i, g in enumerate(_sync(pipe).groups):
        for name, value in optimizer.optimizer.state.get(g.master, {}).items():
            key = f"zero/{_key(pipe, i)}/{name}"
            value = torch.as_tensor(value).detach()
            if value.dim() == 1 and value.numel() == g.hi - g.lo:
                total = (g.layout.total,)
                piece = Piece(key, value, total, total, sbp, tuple(mesh.axes), tuple(mesh.shape), coords)
            else:  # replicated over dp (e.g. Adam's step)
                shape = tuple(value.shape)
                piece = Piece(key, value, shape, shape, tuple(Broadcast() for _ in mesh.axes), tuple(mesh.axes),
                              tuple(mesh.shape), coords)
            out.append(without_axis(piece, pipe.axis))
    return out


@torch.no_grad()
def load_pipeline_zero(ckpt: Checkpoint, pipe: Pipeline, optimizer: ZeroOptimizer) -> None:
    """Load this rank's stage tensors and rebuild its flat optimizer-state shards from a checkpoint of any
    layout (per-parameter state, ZeRO groups, or another pipeline's groups). Local (file reads)."""
    load_pipeline_model(ckpt, pipe)  # the parameters are views of the groups' full buffers: copied in place
    saved, fetch = param_state(ckpt)
    names = _names(pipe)
    groups = _sync(pipe).groups
    fill_flat_state(optimizer.optimizer, groups, [[names[id(q)] for q in g.params] for g in groups], saved, fetch)
