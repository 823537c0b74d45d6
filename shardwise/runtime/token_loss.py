"""Token-weighted losses: every counted target token weighs the same, in every layout, as on one device.

A batch of packed pretraining windows counts every target, so the mean over each micro-batch (``lm_loss``)
averaged over micro-batches and dp ranks *is* the mean over the step's tokens. Loss-masked data (supervised
fine-tuning: only response tokens count, the others carry the target ``IGNORE``) breaks that: micro-batches
count different numbers of tokens, and a mean of means would weigh a token of a short response more than one
of a long response — differently for every split of the batch. Here the loss of one call (a micro-batch, or a
pipeline micro-batch) is its *sum* over counted tokens, divided by the step's total count ``N`` and multiplied
by ``R / r`` (``R`` sequences in the step over all ranks, ``r`` in this call). Each layout averages its calls
over exactly ``R / r`` of them (accumulation passes × dp replicas × pipeline micro-batches), so the step's loss
and gradients are ``Σ CE / N`` over the whole step, whatever the layout.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..comm.collectives import all_reduce
from ..mesh import Mesh
from ..data.windows import IGNORE

__all__ = ["TokenNormalized", "counted_targets"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class TokenNormalized:
    """``loss(logits, targets) = summed(logits, targets) · R / (N · r)`` (module docstring). ``tokens`` (``N``) is
    set once per step, before its passes, by ``counted_targets``; 0 counted tokens make every call 0."""

    def __init__(self, summed: LossFn, global_rows: int) -> None:
        self.summed, self.global_rows = summed, global_rows
        self.tokens = 1

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # targets (r, t): r sequences of this call
        return self.summed(logits, targets) * (self.global_rows / (max(self.tokens, 1) * targets.size(0)))


def counted_targets(batches: list[tuple[torch.Tensor, torch.Tensor]], mesh: Mesh, dp_size: int) -> int:
    """Targets that count (not ``IGNORE``) in the step's batches over every rank: this rank's count, summed over
    the ``dp`` axis when the data is sharded over it (``dp_size`` > 1; a pipeline loads every replica's rows, so
    its count is complete locally). Collective over dp then (one all-reduce of one number)."""
    count = sum(((y != IGNORE).sum() for _, y in batches), torch.zeros((), dtype=torch.int64, device=mesh.device))
    if dp_size > 1:
        all_reduce(count, mesh, "dp", op="sum")
    return int(count)
