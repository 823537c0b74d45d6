"""``ZeroGroups``: what ``ZeroOptimizer`` needs of the model whose flat groups it steps.

Two owners implement it: ``ZeroModel`` (``sw.zero``, stages 1-3) and the pipeline's ZeRO-1 view of its dp
gradient buckets (``parallel/pipeline/grad_sync.py``, ``PipelineZeroGroups``). The optimizer reads gradients
and the accumulation state only through these members, never through the owner's private fields, so either
owner can change its internals freely. No member communicates (all local).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from .flat import FlatGroup

__all__ = ["ZeroGroups"]


class ZeroGroups(Protocol):
    """The flat groups an owner keeps, their gradient buffers, and its accumulation state. Local."""

    @property
    def groups(self) -> Sequence[FlatGroup]:
        """The flat groups, in the order of the gradient lists below."""
        ...

    @property
    def full_grads(self) -> Sequence[torch.Tensor]:
        """Each group's persistent full gradient buffer (ZeRO-1); empty when the owner keeps none (ZeRO 2-3)."""
        ...

    @property
    def shard_grads(self) -> Sequence[torch.Tensor]:
        """This rank's averaged gradient shard of each group (reduced during backward by every owner; zeros
        for a group not reduced since the last step)."""
        ...

    @property
    def syncing(self) -> bool:
        """False inside ``no_sync()``: gradients there are local to each rank and a step must not run."""
        ...

    @property
    def has_unreduced_grads(self) -> bool:
        """Gradients accumulated under ``no_sync()`` that no synchronised backward has reduced yet."""
        ...

    def set_grads_prepared(self, prepared: bool) -> None:
        """The optimizer put this step's gradients into its shards (True) or consumed them (False): a
        backward in between would mix new gradients with prepared ones, which the owner may refuse."""
        ...

    def clear_grads(self) -> None:
        """Forget every gradient the owner keeps (the buffers persist and count as zero afterwards)."""
        ...

    def after_step(self) -> None:
        """Hook run after each optimizer step (e.g. note the memory peak)."""
        ...
