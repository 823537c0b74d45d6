"""The mark an expert-parallel parameter carries: its piece differs on every rank of the expert axis, so the
data-parallel wrappers (DataParallel, ZeRO, a pipeline's dp sync) leave it out of their broadcasts, buckets and
flat groups, and ``parallel/expert/grads.py`` averages its gradient over the ranks holding the same experts."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["EXPERT_ATTR", "is_expert_param", "expert_shard_of"]

EXPERT_ATTR = "_shardwise_expert"
"""Attribute name: the ``parallel.expert.ExpertShard`` the parameter is a piece of."""


def is_expert_param(t: torch.Tensor) -> bool:
    return getattr(t, EXPERT_ATTR, None) is not None


def expert_shard_of(t: torch.Tensor) -> Any:
    """The ``ExpertShard`` of an expert parameter, or None."""
    return getattr(t, EXPERT_ATTR, None)
