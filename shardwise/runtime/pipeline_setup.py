"""The pipeline side of ``shardwise train`` (``parallel.pp > 1``): ``sw.pipeline`` with its hybrids, one step's
accumulation passes, and the checkpoint layout a pipeline rank saves and loads.

Hybrids (``config._check_pipeline_hybrids`` lists what stays rejected):

* dp: ``dp_axis="dp"`` — every rank passes each pass's ``micro_batch × dp`` sequences, each replica takes its
  slice; gradients averaged over dp inside ``pipe.step`` (bucketed, started inside the last backward);
* tp: the GPT is ``sw.parallelize``-d over ``tp`` *before* pipelining (each stage runs its tp shards) and the
  last stage's loss is the vocab-parallel cross-entropy, as without pp;
* ZeRO-1: ``zero_stage=1`` — ``pipe.build_optimizer`` gives a ``ZeroOptimizer`` over the dp gradient buckets of
  this rank's stages (optimizer state 1/dp); its checkpoint layout: ``checkpoint/pipeline_zero.py``;
* activation checkpointing: ``checkpoint=True`` (each unit keeps only its input, recomputed in backward).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from ..checkpoint.pipeline_layout import load_pipeline, pipeline_model_pieces, pipeline_optimizer_pieces
from ..checkpoint.pipeline_zero import load_pipeline_zero, pipeline_zero_groups, pipeline_zero_pieces
from ..checkpoint.sharded import Checkpoint, Piece
from ..mesh import Mesh
from ..models.gpt import lm_loss
from .config import Config

__all__ = ["build_pipeline", "pipeline_passes", "uses_zero", "pipeline_checkpoint", "load_pipeline_checkpoint"]

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def build_pipeline(cfg: Config, mesh: Mesh, plain: nn.Module,
                   optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> tuple[Any, Any]:
    """``(pipe, its optimizer)`` over mesh ``(pp, dp, tp)``; ``optimizer``: the factory (AdamW/SGD of the config)."""
    from ..parallel.pipeline.api import pipeline

    p = cfg.parallel
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = lm_loss
    if p.tp > 1:
        from ..parallel.tensor.api import gpt_plan, parallelize, vocab_parallel_cross_entropy

        plain = parallelize(plain, mesh, gpt_plan(plain.config), axis="tp", seed=cfg.train.seed)
        loss = partial(vocab_parallel_cross_entropy, mesh=mesh, axis="tp", vocab_size=cfg.model.vocab_size)

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss(logits, targets) / p.grad_accum  # one pass of grad_accum, like the plain loop's scaling

    pipe = pipeline(plain, mesh, "pp", microbatches=p.pp_microbatches, schedule=p.pp_schedule, loss_fn=loss_fn,
                    split=list(p.pp_split) or None, chunks=p.pp_chunks, dp_axis="dp", zero_stage=p.zero_stage,
                    checkpoint=p.activation_checkpointing, bucket_cap_mb=p.bucket_cap_mb)
    return pipe, pipe.build_optimizer(optimizer)


def uses_zero(pipe: Any) -> bool:
    """Whether the optimizer is ZeRO-1 over dp (``zero_stage=1`` with dp > 1; at dp = 1 it is a plain one)."""
    return pipe.grad_sync is not None and pipe.grad_sync.zero


def pipeline_passes(pipe: Any, batches: Batches, t: dict[str, float]) -> float:
    """One ``pipe.step`` per accumulation pass; returns the step's mean loss (same on every rank). Times: this
    rank's F actions → fwd, B and W → bwd, the rest of ``pipe.step`` (waiting for neighbours — bubble and
    transfers —, tied-weight exchange, dp reduction) → comm. On CUDA the split is of launch times unless
    ``pipe.interpreter.synchronize_timings`` is set; the step time is exact (``step`` syncs)."""
    total = 0.0
    for x, y in batches:
        start = time.perf_counter()
        total += pipe.step(x, y)  # mean over micro-batches and dp of lm_loss / grad_accum
        elapsed = time.perf_counter() - start
        fwd = sum(end - begin for a, begin, end in pipe.last_events if a.kind == "F")
        bwd = sum(end - begin for a, begin, end in pipe.last_events if a.kind != "F")
        t["fwd"], t["bwd"], t["comm"] = t["fwd"] + fwd, t["bwd"] + bwd, t["comm"] + max(0.0, elapsed - fwd - bwd)
    return total


def pipeline_checkpoint(pipe: Any, optimizer: Any) -> tuple[list[Piece], dict[str, Any], dict[str, Any]]:
    """``(this rank's pieces, entries for the index state, entries for this rank's file)``: its own stages'
    tensors under the plain model's keys, and their optimizer state — per parameter, or ZeRO-1's flat shards
    with this rank's group list. Local."""
    pieces = pipeline_model_pieces(pipe)
    if uses_zero(pipe):
        return (pieces + pipeline_zero_pieces(pipe, optimizer), {"pipeline_zero_groups": True},
                {"zero_groups": pipeline_zero_groups(pipe)})
    return pieces + pipeline_optimizer_pieces(pipe, optimizer), {}, {}


def load_pipeline_checkpoint(ckpt: Checkpoint, pipe: Any, optimizer: Any) -> None:
    """This rank's stage tensors and optimizer state from a checkpoint of any layout. Local (file reads)."""
    if uses_zero(pipe):
        load_pipeline_zero(ckpt, pipe, optimizer)
    else:
        load_pipeline(ckpt, pipe, optimizer)
