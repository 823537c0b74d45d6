"""Small pieces of the training loop (``trainer.py``): the mesh, the learning-rate schedule, the device wait that makes
host clocks measure device work, and the hint appended to a failed collective's message. Pure or local."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..mesh import Mesh
from .config_schema import OptimizerConfig, ParallelConfig
from .strategy import mesh_axes

__all__ = ["lr_at", "build_mesh", "synchronizer", "peer_hint"]


def build_mesh(p: ParallelConfig, timeout_s: float | None = None, calibration: Sequence[Any] = ()) -> Mesh:
    """The layout's mesh (``mesh_axes``); ``timeout_s``: the collective deadline of its groups (the steps);
    ``calibration``: the collective models ``algorithm = "auto"`` picks from (``runtime/calibration.py``)."""
    return Mesh(**mesh_axes(p), timeout_s=timeout_s, calibration=list(calibration))


def lr_at(step: int, o: OptimizerConfig, total: int) -> float:
    """Learning rate of optimizer step ``step`` (1-based): linear warmup to ``lr``, then cosine to ``min_lr``."""
    if o.warmup_steps and step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    if o.schedule == "constant" or total <= o.warmup_steps:
        return o.lr
    progress = min(1.0, (step - o.warmup_steps) / (total - o.warmup_steps))
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + math.cos(math.pi * progress))


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for queued GPU work so host timestamps measure it (no-op on the CPU)."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def peer_hint(exc: BaseException, timeout_s: float) -> str:
    """A line for a rank's failure message when ``exc`` looks like a collective that lost its peers, else ''."""
    text = str(exc).lower()
    if any(s in text for s in ("connection closed", "connection reset", "timed out", "timeout", "broken pipe")):
        return (f"\n  (a collective failed: another rank died or stopped responding within train.timeout_s="
                f"{timeout_s:g}s; the launcher's report names the first rank that failed)")
    return ""
