"""Small pieces of the training loop (``trainer.py``): the mesh, the learning-rate schedule, the device wait that makes
host clocks measure device work, and the hint appended to a failed collective's message. Pure or local."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch

from ..mesh import Mesh
from .config_schema import OptimizerConfig, ParallelConfig
from .strategy import mesh_axes

__all__ = ["lr_at", "build_mesh", "synchronizer", "peer_hint", "MoESteps"]


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


class MoESteps:
    """The trainer's per-step calls of ``runtime/experts.py`` (no-ops for a dense model): the balancing loss'
    share per pass before the passes, the expert gradient sync after them, the bias update and routing statistics
    after the optimizer step. ``strategy.experts``: set by ``build_strategy``; a strategy may define
    ``moe_passes(n)`` (pipelines: n × micro-batches)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy, self.experts = strategy, getattr(strategy, "experts", None)
        self.stats: dict[str, dict[str, float]] | None = None

    def before(self, n_batches: int) -> None:
        """Each pass's balancing loss weighs 1 / (the step's passes). Local."""
        if self.experts is not None:
            count = getattr(self.strategy, "moe_passes", None)
            self.experts.grad_scale(count(n_batches) if callable(count) else n_batches)

    def synced(self) -> None:
        """After the passes: expert pieces' gradients averaged (collective over edp; see ``Experts``)."""
        if self.experts is not None:
            self.experts.sync_grads()

    def after(self, stepped: bool) -> None:
        """After the optimizer step: bias update and statistics (collective over dp); a skipped step only
        forgets its counts. Local then."""
        if self.experts is None:
            return
        if stepped:
            self.stats = self.experts.after_step()
        else:
            self.experts.skipped()
            self.stats = None

    def record(self) -> dict[str, Any]:
        """The metrics record's ``moe`` entry: per MoE block ``aux`` (the balancing loss, apart from the
        logged LM loss), ``min``/``max``/``cv`` of the tokens per expert, ``dropped``, ``starved``."""
        return {"moe": self.stats} if self.stats is not None else {}

    def warnings(self) -> list[str]:
        return self.experts.warnings() if self.experts is not None else []
