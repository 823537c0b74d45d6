"""The validation pass of ``shardwise train`` (``train.eval_every``): fixed batches, forward only, every layout.

The validation loss is the mean cross-entropy over every counted target token of ``K`` global batches (``K =
train.eval_batches``; targets a loss mask excludes do not count), computed by the layout's forward alone —
``Strategy.eval_sums``: the plain, dp, tp and ZeRO layouts run ``model(x)`` under ``torch.no_grad`` and sum
over dp; pipelines run a forward-only schedule (``Pipeline.evaluate``). Sums, not means of means, so that
one device and every layout average the same tokens with the same weights.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch
from torch import nn

from ..data.windows import TokenWindows

__all__ = ["ValBatches", "evaluate"]


class ValBatches:
    """A rank's validation batches: the first ``eval_batches`` global batches of the validation windows in order
    (fewer when fewer fit), each rank taking its ``dp`` stride of every batch, cut into passes of ``micro_batch``
    rows — the same batches at every evaluation, the same ``K·G`` sequences in every layout. Kept on the device
    after the first evaluation when they are small (≤ 64 MiB), so later evaluations cost their forwards only."""

    CACHE_BYTES = 64 * 2**20

    def __init__(self, windows: TokenWindows, *, global_batch: int, eval_batches: int, dp_size: int, dp_rank: int,
                 micro_batch: int, device: torch.device,
                 transform: Callable[[list[tuple[torch.Tensor, torch.Tensor]]], list[tuple[torch.Tensor, torch.Tensor]]]
                 | None = None) -> None:
        self.windows, self.device, self.micro_batch = windows, device, micro_batch
        self.transform = transform  # context parallelism: this rank's sequence chunks
        self.count = min(eval_batches, len(windows) // global_batch)
        self.rows = [b * global_batch + k for b in range(self.count) for k in range(dp_rank, global_batch, dp_size)]
        self._cached: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(idx, targets)`` pairs of shape (micro_batch, block_size), int64 on the device."""
        if self._cached is not None:
            return self._cached
        rows = [self.windows[i] for i in self.rows]
        x = torch.stack([r[0] for r in rows]).to(self.device)
        y = torch.stack([r[1] for r in rows]).to(self.device)
        out = list(zip(x.split(self.micro_batch), y.split(self.micro_batch)))
        if self.transform is not None:
            out = self.transform(out)
        if 2 * x.numel() * x.element_size() <= self.CACHE_BYTES:
            self._cached = out
        return out


def evaluate(strategy: Any, plain: nn.Module, val: ValBatches, step: int) -> dict[str, Any]:
    """The validation record at ``step``: ``{"kind": "eval", "step", "val_loss", "val_ppl", "val_tokens",
    "val_batches", "eval_s"}``, the same on every rank. Dropout off during the pass. Collective."""
    start = time.perf_counter()
    was_training = plain.training
    plain.train(False)
    try:
        total, count = strategy.eval_sums(val.batches())
    finally:
        plain.train(was_training)
    loss = total / count if count else float("nan")
    return {"kind": "eval", "step": step, "val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else float("inf"),
            "val_tokens": count, "val_batches": val.count, "eval_s": time.perf_counter() - start}
