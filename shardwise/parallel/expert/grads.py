"""Expert gradients under expert parallelism. A rank's expert gradient already sums the contributions of every
token its ep group sent it (the backward all-to-all brings them), so averaging like one device means: sum over
the ranks that hold the same experts (the ``edp`` axis: data-parallel ranks / ep), then divide by all the
data-parallel ranks whose losses are averaged (dp × cp). One coalesced all-reduce per dtype; none when every
data-parallel rank is an expert rank (edp = 1), only the division."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...comm.collectives import all_reduce
from ...mesh import Mesh

__all__ = ["ExpertGradSync"]


class ExpertGradSync:
    """``sync()`` after the step's backward passes: every expert parameter's ``.grad`` becomes the one-device
    average. ``mesh``/``axis``: the ranks holding the same experts; ``data_ranks``: dp × cp (the divisor)."""

    def __init__(self, params: Sequence[nn.Parameter], mesh: Mesh, axis: str, data_ranks: int) -> None:
        self.params, self.mesh, self.axis, self.data_ranks = list(params), mesh, axis, data_ranks

    def sync(self) -> None:
        """Collective over ``axis`` (every rank calls, with or without gradients: missing ones count as 0)."""
        if not self.params:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.params:
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for group in by_dtype.values():
            flat = torch.cat([p.grad.reshape(-1) for p in group])
            if self.mesh.size(self.axis) > 1:
                all_reduce(flat, self.mesh, self.axis, op="sum")
            flat.div_(self.data_ranks)
            at = 0
            for p in group:
                n = p.numel()
                p.grad.copy_(flat[at: at + n].view_as(p.grad))
                at += n
