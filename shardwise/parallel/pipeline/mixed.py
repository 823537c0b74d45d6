"""``sw.MixedPrecision`` inside a pipeline: bf16 compute parameters and gradients, fp32 master weights in ZeRO's shards.

``sw.pipeline(..., dp_axis="dp", zero_stage=1|2|3, mixed_precision=sw.MixedPrecision())``: each dp gradient bucket
(ZeRO-3: each unit) is a flat group whose full buffer is in ``param_dtype`` while this rank's master shard keeps the
parameters' own dtype (fp32) — the ZeRO paper's ``2Ψ + 2Ψ + 12Ψ`` accounting, sharded per stage. Every micro-batch
computes with the bf16 parameters; gradients accumulate in bf16 over the step and are reduce-scattered in
``reduce_dtype`` (fp32 by default here: a bf16 sum over dp rounds); the optimizer steps the fp32 master shard and
casts it back. Buffers, frozen parameters and floating inputs compute in ``param_dtype`` too. Only bf16: fp16 needs
loss scaling, which a pipeline's per-micro-batch backwards do not run (use ``sw.zero`` for fp16).
``full_state_dict`` returns the fp32 master weights (``masters_gathered``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..common.mixed_precision import MixedPrecision
from ..zero.expert_pieces import gather_master

__all__ = ["check_mixed_precision", "reduce_dtype_of", "cast_the_rest", "cast_inputs", "masters_gathered"]


def check_mixed_precision(mp: Any, zero_stage: int, dp_size: int, autocast: Any) -> None:
    """``ValueError`` / ``TypeError`` for a policy a pipeline cannot run (pure)."""
    if mp is None:
        return
    if not isinstance(mp, MixedPrecision):
        raise TypeError(f"mixed_precision must be a shardwise.MixedPrecision or None, got {type(mp).__name__}; "
                        f"e.g. sw.MixedPrecision(param_dtype=torch.bfloat16)")
    if mp.param_dtype != torch.bfloat16:
        raise ValueError(f"pipeline mixed_precision param_dtype = {mp.param_dtype} needs loss scaling, which "
                         f"pipelines do not run; use param_dtype=torch.bfloat16, or sw.zero without a pipeline")
    if not zero_stage or dp_size < 2:
        raise ValueError(f"pipeline mixed_precision keeps the fp32 master weights in ZeRO's shards, but zero_stage = "
                         f"{zero_stage} over a dp axis of size {dp_size}; pass dp_axis (size >= 2) and zero_stage "
                         f"1, 2 or 3, or autocast=torch.bfloat16 (fp32 weights, bf16 compute)")
    if autocast is not None:
        raise ValueError("pipeline mixed_precision and autocast both set the compute dtype; pass one of them "
                         "(mixed_precision: bf16 weights with fp32 masters; autocast: fp32 weights)")


def reduce_dtype_of(mp: MixedPrecision | None, compute: torch.dtype) -> torch.dtype:
    """The dtype gradients are reduced in: the policy's, else fp32 under mixed precision, else ``compute``."""
    if mp is None:
        return compute
    return mp.reduce_dtype or torch.float32


@torch.no_grad()
def cast_the_rest(stages: dict[int, nn.Module], managed: set[int], dtype: torch.dtype) -> None:
    """Floating buffers and parameters in no flat group (frozen ones) compute in ``dtype`` too."""
    for stage in stages.values():
        for t in [*stage.parameters(), *stage.buffers()]:
            if id(t) not in managed and t.is_floating_point() and t.dtype != dtype:
                t.data = t.data.to(dtype)


def cast_inputs(inputs: list[Any], dtype: torch.dtype | None) -> list[Any]:
    """Each micro-batch's floating input tensors in the compute dtype (token ids stay integers)."""
    if dtype is None:
        return inputs
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
    return [pytree.tree_map(cast, mb) for mb in inputs]


@contextmanager
def masters_gathered(groups: list[Any], zero3: bool) -> Iterator[None]:
    """Inside the block every grouped parameter holds the whole fp32 master (each group's master shards all-gathered
    over dp, collective); afterwards the compute views come back (ZeRO-3: freed)."""
    for g in groups:
        for p, view in zip(g.params, g.views(gather_master(g))):  # (L,) fp32, every dp shard
            p.data = view
    try:
        yield
    finally:
        for g in groups:
            if zero3:
                g.free()
            else:
                g._point_params()  # the compute-dtype views of the full buffer
