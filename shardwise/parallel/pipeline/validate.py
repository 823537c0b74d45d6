"""Validation of ``sw.pipeline``'s arguments: pure, before any communication; each error states the
constraint, the values and the fix."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

from ...mesh import Mesh
from ..common.selective import check_attention, check_mode
from .schedules import SCHEDULES, _did_you_mean
from .stage import Stage

__all__ = ["check_args", "check_hybrid", "check_keys", "checkpoint_mode"]


def check_keys(model: nn.Module, stages: list[Stage]) -> None:
    names = [n for s in stages for n in s.owned_names()]
    loose = [k for k in model.state_dict() if not any(k.startswith(n + ".") for n in names)]
    if loose:
        raise ValueError(f"model tensors {loose[:5]} belong to no pipeline unit (units run {names[:6]}...); "
                         f"register them inside the modules the stages run")


def check_hybrid(mesh: Mesh, axis: str, dp_axis: str | None, zero_stage: Any, checkpoint: Any,
                  bucket_cap_mb: Any, graph: bool = False) -> None:
    if dp_axis is not None and (dp_axis not in mesh.axes or dp_axis == axis):
        raise ValueError(f"dp_axis {dp_axis!r} must be an axis of {mesh!r} other than the pipeline axis "
                         f"{axis!r}; use one of {[a for a in mesh.axes if a != axis]} or dp_axis=None")
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"pipeline zero_stage must be 0, 1, 2 or 3 (ZeRO over dp_axis: 1 optimizer state, 2 also "
                         f"gradients, 3 also parameters), got {zero_stage!r}")
    if zero_stage and dp_axis is None:
        raise ValueError(f"pipeline zero_stage={zero_stage} shards over the data-parallel axis, but dp_axis is None; "
                         f"pass dp_axis='dp' (an axis of the mesh) or zero_stage=0")
    if zero_stage == 3 and graph:
        raise ValueError("pipeline zero_stage=3 gathers each unit of a chain pipeline as it runs, but this pipeline "
                         "was captured from example_inputs (a graph pipeline, whose stages have no units); use "
                         "zero_stage 1 or 2, or a chain pipeline (no example_inputs)")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a number > 0 (MB of gradients per dp reduction), got "
                         f"{bucket_cap_mb!r}; the default is 25")
    if not isinstance(checkpoint, bool) and checkpoint not in ("none", "full", "selective"):
        raise TypeError(f"checkpoint must be True or False (recompute each unit's activations in backward), or "
                        f"'none', 'full' or 'selective' (keep the weight matmuls' outputs), got {checkpoint!r}")


def check_args(mesh: Mesh, axis: str, microbatches: int, schedule: str, loss_fn: Callable | None, chunks: int,
               graph: bool = False) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"sw.pipeline needs mesh= a shardwise.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axes:
        raise ValueError(f"pipeline axis {axis!r} is not an axis of {mesh!r}; use one of {list(mesh.axes)}")
    if not isinstance(schedule, str) or schedule.lower() not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid schedules: {', '.join(SCHEDULES)}"
                         f"{_did_you_mean(str(schedule), SCHEDULES)}")
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise ValueError(f"chunks must be an integer >= 1, got {chunks!r}")
    if loss_fn is None and not graph:
        raise TypeError("loss_fn is required: a chain pipeline's last stage returns the model output, and "
                        "loss_fn(output, targets) turns it into the loss; (loss_fn=None works with example_inputs= "
                        "for a model that returns its own loss, e.g. given labels=)")
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable as loss_fn(output, targets) -> scalar, got {loss_fn!r}")


def checkpoint_mode(model: nn.Module, checkpoint: Any, schedule: str, split_backward: bool) -> str:
    """The activation checkpointing mode of ``checkpoint`` (``True``/``False`` mean full/none). ``selective`` needs
    attention in the model and a schedule without split backward: zero-bubble's weight-gradient pass
    differentiates each stage a second time, which torch's selective checkpoint forbids."""
    mode = check_mode(checkpoint)
    if mode == "selective":
        check_attention([(f"the model ({type(model).__name__})", model)])
        if split_backward:
            raise ValueError(f"selective activation checkpointing with schedule {schedule!r}: its weight-gradient "
                             f"pass differentiates each stage a second time, which torch's selective checkpoint "
                             f"forbids; use checkpoint='full' (--parallel.activation_checkpointing full) or a "
                             f"schedule without split backward (1f1b, interleaved, gpipe)")
    return mode
