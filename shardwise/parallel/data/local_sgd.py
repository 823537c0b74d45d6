"""Parameter averaging (local SGD) for ``DataParallel(average="parameters", period=k)``.

Each replica takes ``k`` optimizer steps on its own gradients, with no gradient communication at all; then
the parameters are averaged over the axis (one all-reduce per dtype of a flat copy). With ``k = 1`` and
plain SGD (momentum and weight decay included: both are linear in the gradients) this is exactly gradient
averaging; with Adam it is not (the update is a non-linear function of the gradient), and with ``k > 1``
the replicas drift apart between averages, which costs convergence per sample in exchange for ``k`` times
fewer (and larger, easily overlapped) messages — Lin et al. 2020, "Don't use large mini-batches, use local SGD".
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ...mesh import Mesh
from .replicas import average_coalesced

__all__ = ["ParameterAverager"]


class ParameterAverager:
    """Counts optimizer steps and averages parameters (and optionally optimizer state) every ``period``."""

    def __init__(self, params: list[nn.Parameter], mesh: Mesh, axis: str, *, period: int, algorithm: str) -> None:
        self.params, self.mesh, self.axis = params, mesh, axis
        self.period, self.algorithm = period, algorithm
        self.steps = 0
        """Calls of ``step`` so far (optimizer steps taken)."""
        self.averages = 0
        """Times the parameters were averaged."""

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Count one optimizer step; on every ``period``-th, average the parameters over the axis (and, with
        ``optimizer``, its floating per-parameter state such as Adam's moments). Returns whether it averaged.
        Collective on the averaging steps: every rank must call it after every optimizer step."""
        self.steps += 1
        if self.steps % self.period != 0:
            return False
        tensors: list[torch.Tensor] = list(self.params)
        if optimizer is not None:
            for p in self.params:
                state = optimizer.state.get(p, {})
                # Only tensors shaped like the parameter: scalar step counters are equal on every rank already.
                tensors += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)
                            and v.is_floating_point() and v.shape == p.shape]
        average_coalesced(tensors, self.mesh, self.axis, algorithm=self.algorithm)
        self.averages += 1
        return True
