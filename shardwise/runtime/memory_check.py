"""``shardwise train`` refuses a layout predicted not to fit (``train.memory_check``): before any rank starts, the
launch's prediction (``prediction.predict_launch``: the same hardware and plan as the printed prediction) says each
rank's peak — the larger of building the model and training it — and a peak over a device's memory is one error
line naming the layout, both sizes and the fix.

The memory per rank is the hardware's: a GPU's own memory, or on CPU ranks the host's physical RAM divided among
the ranks on it (the quick probe and ``shardwise calibrate`` both count it so). A prediction that cannot be made
(a layout the planner does not know) refuses nothing; the launcher then prints ``prediction skipped``.
"""

from __future__ import annotations

from typing import Any

from .config import Config

__all__ = ["check_memory", "memory_refusal"]


def check_memory(cfg: Config, *, device: str, nproc: int) -> None:
    """``ValueError`` (one line) when ``cfg``'s layout is predicted not to fit; nothing when it fits, when
    ``train.memory_check`` is false, with ``parallel.auto`` (its search kept only layouts that fit), or when the
    prediction fails."""
    if not cfg.train.memory_check or cfg.parallel.auto:
        return
    from .prediction import predict_launch

    try:
        pred, _ = predict_launch(cfg, device=device, nproc=nproc)
    except Exception:  # noqa: BLE001 - no prediction, no verdict: the launcher reports it and trains
        return
    message = memory_refusal(pred, cfg, device=device, nproc=nproc)
    if message:
        raise ValueError(message)


def memory_refusal(pred: Any, cfg: Config, *, device: str, nproc: int) -> str | None:
    """The refusal of a ``Prediction`` that does not fit (None when it fits). Pure."""
    from .metrics import format_bytes

    mem = pred.memory
    if mem.fits:
        return None
    where = ("of GPU memory" if device == "cuda"
             else f"of the host's RAM shared by {nproc} rank{'s' * (nproc != 1)}")
    peak = ("building the model: its kept parameters and the largest full tensor in flight"
            if mem.largest == "construction" else f"training; largest term: {mem.largest}")
    return (f"layout {pred.plan.describe()} is predicted to need {format_bytes(mem.total)} per rank at its peak "
            f"({peak}) but a rank has {format_bytes(mem.capacity)} {where}; {_remedies(cfg, mem.largest)}, or "
            f"--parallel.auto true to choose a layout that fits; --train.memory_check false launches it anyway")


def _remedies(cfg: Config, largest: str) -> str:
    """The config changes that shrink what the prediction says is largest (first the ones that shard more)."""
    p = cfg.parallel
    out = []
    if p.zero_stage < 3 and p.dp != 1:  # inside pipelines too
        out.append("--parallel.zero_stage 3 (shards the model states over dp)")
    elif p.tp == 1 and p.pp == 1:
        out.append("--parallel.tp or --parallel.pp > 1 (splits the model)")
    if largest == "activations":
        if p.activation_checkpointing != "full":
            out.append("--parallel.activation_checkpointing " + ("full" if p.activation_checkpointing == "selective"
                                                                   else "selective (or full)"))
        if p.micro_batch > 1:
            out.append(f"a smaller --parallel.micro_batch (now {p.micro_batch})")
    out.append("a smaller model")
    return "try " + ", ".join(out)
