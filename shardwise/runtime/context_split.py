"""Context parallelism in ``shardwise train`` (``parallel.cp > 1``): the meshes and each rank's sequence chunks.

The ranks of one data-parallel replica that differ only in their ``cp`` coordinate see the same sequences,
each its two chunks of every one (``sw.shard_sequence``: chunks i and 2·cp−1−i of 2·cp). Everything but
attention is per token, so every layout treats the ``dp × cp`` ranks as data-parallel replicas of ``S / cp``
tokens each: the strategies run on a mesh whose ``dp`` axis is ``dp × cp`` wide (the same ranks in the same
order as ``(dp, cp)``: ``cp`` is the inner of the two), so gradients average, ZeRO shards and losses reduce over
both — a mean over equal local token counts is the global mean — while ``sw.context_parallel`` runs the
attention over a second mesh with the ``cp`` axis itself.

A mixture of experts' blocks are per token too, except their per-sequence rules — the balancing loss and the
capacity count a whole sequence (``models/moe_balance.py``) — so each block gets ``sequence =
SequenceSplit(cp mesh, "cp")``: its statistics are summed over the cp ranks first, and every layout gives one
device's numbers. Expert parallelism folds into the same ``dp × cp`` ranks (``runtime/experts.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..mesh import Mesh
from ..models.moe_balance import SequenceSplit, moe_blocks
from ..parallel.context import context_parallel, shard_sequence
from .config_schema import Config, ParallelConfig

__all__ = ["cp_mesh_axes", "ContextSplit", "context_split"]

Pair = tuple[torch.Tensor, torch.Tensor]


def cp_mesh_axes(p: ParallelConfig) -> dict[str, int]:
    """The attention mesh's axes: ``(pp, dp, cp, tp)`` (``pp`` only with a pipeline), ``cp`` inside ``dp``."""
    axes = dict(dp=p.dp, cp=p.cp, tp=p.tp)
    return dict(pp=p.pp, **axes) if p.pp > 1 else axes


class ContextSplit:
    """Cuts a step's ``(idx, targets)`` pairs into this rank's sequence chunks.

    Without a pipeline each pair is this replica's rows (b, S) → (b, S / cp). A pipeline loads every replica's
    rows ((dp · b, S), replica d's rows the d-th block) and slices them by the coordinate of its ``dp × cp``
    axis, block ``d · cp + c`` for replica d at cp coordinate c: the pair becomes (dp · cp · b, S / cp) holding
    every replica's rows cut for every cp coordinate, in that order — each rank then takes its own."""

    def __init__(self, cp_mesh: Mesh, *, pipeline: bool, dp: int) -> None:
        self.mesh, self.pipeline, self.dp = cp_mesh, pipeline, dp
        self.cp = cp_mesh.size("cp")

    def _chunks(self, t: torch.Tensor, coord: int) -> torch.Tensor:
        # (rows, S) -> (rows, S / cp): chunks coord and 2·cp−1−coord of 2·cp along the sequence
        pieces = t.chunk(2 * self.cp, dim=1)
        return torch.cat([pieces[coord], pieces[2 * self.cp - 1 - coord]], dim=1)

    def _arrange(self, t: torch.Tensor) -> torch.Tensor:
        # (dp · b, S) -> (dp · cp · b, S / cp): replica-major, then cp coordinate
        return torch.cat([self._chunks(block, c) for block in t.chunk(self.dp) for c in range(self.cp)])

    def __call__(self, pairs: Sequence[Pair]) -> list[Pair]:
        if self.pipeline:
            return [(self._arrange(x), self._arrange(y)) for x, y in pairs]
        return [(shard_sequence(x, self.mesh, "cp", dim=1), shard_sequence(y, self.mesh, "cp", dim=1))
                for x, y in pairs]


def context_split(cfg: Config, model: nn.Module) -> ContextSplit | None:
    """With ``parallel.cp > 1``: the attention mesh ``(pp, dp, cp, tp)``, ``model``'s attention routed to the ring
    over its ``cp`` axis (``sw.context_parallel`` on the module the strategy runs), and the batch cutter; None
    otherwise. Collective (the mesh's groups)."""
    p = cfg.parallel
    if p.cp <= 1:
        return None
    cp_mesh = Mesh(**cp_mesh_axes(p), timeout_s=cfg.train.timeout_s)
    context_parallel(model, cp_mesh, "cp")
    split = SequenceSplit(cp_mesh, "cp")
    for _, block in moe_blocks(model):  # balancing loss and capacity per whole sequence (module docstring)
        block.sequence = split
    return ContextSplit(cp_mesh, pipeline=p.pp > 1, dp=p.dp)
