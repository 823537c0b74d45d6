"""The optimizer of a pipeline rank's stages: a plain one, or ZeRO's over the dp gradient buckets."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
from torch import nn

from ..common.mixed_precision import LossScaler
from ..zero.optim import ZeroOptimizer, make_inner_optimizer
from .grad_sync import PipelineZeroGroups

__all__ = ["pipeline_optimizer"]


def pipeline_optimizer(pipe: Any, factory: Callable[..., torch.optim.Optimizer]) -> torch.optim.Optimizer | ZeroOptimizer:
    """``Pipeline.build_optimizer`` (see there)."""
    if pipe.zero_stage == 0 or pipe.grad_sync is None:
        return make_inner_optimizer(factory, list(pipe.parameters()))
    sync, experts = pipe.grad_sync, pipe.expert_params()
    dtype = sync.reduce_dtype or (sync.buckets[0].dtype if sync.buckets else torch.float32)
    # ZeroOptimizer's stage-2 path takes gradient shards that are already averaged: DpGradSync's reduce-scatters
    # produced them during the step. Expert-parallel parameters are in no flat group (each dp rank of an expert
    # group holds other experts): the same inner optimizer steps them whole, after the caller's ExpertGradSync.
    inner = factory if not experts else partial(_with_experts, factory, experts)
    # stages 1-2 all-gather the updated parameters after the step; stage 3 gathers each unit as it next runs
    return ZeroOptimizer(PipelineZeroGroups(sync, experts), inner, sync.groups, pipe.mesh, sync.axis,
                         stage=3 if pipe.zero_stage == 3 else 2, scaler=LossScaler(pipe.mixed_precision),
                         reduce_dtype=dtype)


def _with_experts(factory: Callable[..., torch.optim.Optimizer], experts: list[nn.Parameter],
                  masters: list[nn.Parameter]) -> torch.optim.Optimizer:
    """ZeRO's inner optimizer over the flat master shards and the expert parameters (same hyperparameters)."""
    return factory(list(masters) + experts)
