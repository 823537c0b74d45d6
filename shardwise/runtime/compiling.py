"""``train.compile``: regional ``torch.compile`` of the trainer's model in every layout, its validation before
launch, and what the run reports about it (compile time and recompilations in the progress line, the metrics and
the summary).

Where the strategies compile (``strategy/``): the plain, data-parallel, tensor-parallel and ZeRO layouts after the
model is wrapped (``build_strategy``: ``sw.compile`` goes last, after ``parallelize``, activation checkpointing,
``DataParallel``, ``zero``); a pipeline before ``sw.pipeline`` cuts the model (its stages call the same block
modules, and its zero-bubble weight capture must see the compiled regions). Context parallelism is refused: its
ring attention swaps attention in through a ``TorchFunctionMode`` around the whole forward, which dynamo would
trace into each block's graph.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .config_schema import Config

__all__ = ["check_compile", "compile_model", "CompileWatch"]


def check_compile(config: Config) -> None:
    """Refuse what ``train.compile`` cannot run with, before anything launches. Raises ``ValueError`` naming the
    constraint, the values and the fix. Imports dynamo (a few seconds) only when ``train.compile`` is set."""
    t, p = config.train, config.parallel
    if not t.compile:
        return
    if p.cp > 1:
        raise ValueError(f"train.compile = true with parallel.cp = {p.cp} is not supported: ring attention runs "
                         f"through a TorchFunctionMode around the whole forward, which torch.compile would trace "
                         f"into every block; use --parallel.cp 1, or --train.compile false")
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if t.compile_backend not in known:
        raise ValueError(f"train.compile_backend = {t.compile_backend!r} is not a torch.compile backend; choose one "
                         f"of {sorted(known)}, e.g. --train.compile_backend inductor")


def compile_model(cfg: Config, model: nn.Module) -> nn.Module:
    """``model``'s transformer blocks compiled in place when ``train.compile`` (else unchanged). Local."""
    if not cfg.train.compile:
        return model
    from ..parallel.common.compile import compile as regional
    from .model_build import block_names

    return regional(model, backend=cfg.train.compile_backend, regions=block_names(model) or None)


class CompileWatch:
    """The trainer's view of a compiled model: recompilations since the last step (for the progress line and
    the metrics record) and the summary's entries. Inactive (no entries) when the model was not compiled."""

    def __init__(self, model: nn.Module) -> None:
        from ..parallel.common.compile import compiled_regions, on_recompile

        self.model = model
        self.active = bool(compiled_regions(model))
        self.pending: list[str] = []
        if self.active:
            on_recompile(model, self.pending.append)

    def take(self) -> list[str]:
        """The recompilations (one reason each) since the last call."""
        out, self.pending = self.pending, []
        return out

    def note(self, progress: Any, step: int) -> None:
        """One progress line per recompilation since the last call (``ProgressReporter.note``)."""
        for reason in self.take():
            progress.note(f"recompile at step {step}: {reason}")

    def record(self) -> dict[str, Any]:
        """Entries of a step's metrics record: the recompilations so far (none when not compiled)."""
        if not self.active:
            return {}
        from ..parallel.common.compile import compile_stats

        return {"recompiles": compile_stats(self.model).recompiles}

    def summary(self, first_step_s: float | None, step_s: float) -> dict[str, Any]:
        """The summary's entries: dynamo's compile seconds in this process, the first step's excess over the
        median step (what compiling cost the run, lazily compiled backward included), graphs, graph breaks
        and recompilations."""
        if not self.active:
            return {}
        from ..parallel.common.compile import compile_stats

        s = compile_stats(self.model)
        excess = max(0.0, first_step_s - step_s) if first_step_s is not None else None
        return {"compile_s": s.compile_s, "compile_first_step_excess_s": excess, "compile_graphs": s.graphs,
                "compile_graph_breaks": s.graph_breaks, "recompiles": s.recompiles,
                "recompile_reasons": s.reasons[:5]}
