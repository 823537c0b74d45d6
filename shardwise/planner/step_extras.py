"""What a training step costs besides the layers and the layout's collectives: the optimizer update and the
per-step syncs of ``shardwise train`` (``predict`` adds both to every step)."""

from __future__ import annotations

import math

from .hardware import Hardware
from .plan import Layout

__all__ = ["optimizer_time", "step_syncs", "fused_optimizer"]


def step_syncs(plan: Layout, hw: Hardware) -> tuple[float, float]:
    """What ``shardwise train`` adds to every step besides the layout's own traffic: the non-finite check's
    one-number ``max`` all-reduce over each mesh axis before the optimizer step, and the loss's mean over dp
    after it (a pipeline's loss is already the mean). Latency-bound: a gloo all-reduce of 4 bytes is ~0.6 ms
    between CPU ranks, microseconds with NCCL."""
    per_dp = min(plan.dp, max(1, hw.devices_per_node // plan.tp))
    per_cp = min(plan.zero_group, max(1, hw.devices_per_node // plan.tp))  # dp × cp: who saw the batch's tokens
    sizes = [(plan.dp, per_dp), (plan.tp, min(plan.tp, hw.devices_per_node)), (plan.pp, 1), (plan.cp, min(plan.cp, per_cp))]
    flag = sum(hw.collective_time("all_reduce", 4, n, per_node=k, algorithm="native") for n, k in sizes if n > 1)
    loss = (hw.collective_time("all_reduce", 4, plan.zero_group, per_node=per_cp, algorithm="native")
            if plan.pp == 1 else 0.0)
    return flag, loss


def optimizer_time(plan: Layout, hw: Hardware, n_local: float, tensors: int, fused: bool,
                   multi_tensor: bool = False) -> float:
    """Seconds of one optimizer step on one rank. ``multi_tensor``: a fused kernel covers a chunk of tensors per
    launch (torch's fused AdamW, what ``shardwise train`` runs); else one launch per tensor (the published
    Megatron runtime, as priced so far)."""
    shard = n_local / (plan.zero_group if plan.zero_stage >= 1 else 1)
    # A fused AdamW (Megatron's, and shardwise train's on CUDA: optimizer.implementation = auto) reads param,
    # grad, m, v and writes param, m, v once: 28 bytes per element. The unfused torch.optim.AdamW (shardwise
    # train on CPU ranks) runs it as about ten elementwise passes (decay, two moment updates, sqrt, divide,
    # add): about 80 bytes. Both plus the 4-byte gradient-norm read.
    per = 28 + 4 if fused else 80 + 4
    if fused and multi_tensor and hw.kind == "gpu":
        # torch's fused AdamW is one multi-tensor kernel per chunk of tensors
        launches = 12 + math.ceil(tensors / _FOREACH_TENSORS_PER_LAUNCH)
    elif fused:
        launches = 12 + tensors
    elif hw.kind == "gpu":
        # on CUDA torch.optim.AdamW defaults to its foreach form: each of the ~10 passes is one multi-tensor
        # launch per chunk of tensors (tens of tensors per launch), not one per tensor
        launches = 12 + 10 * math.ceil(tensors / _FOREACH_TENSORS_PER_LAUNCH)
    else:
        launches = 12 + 10 * tensors  # CPU: the per-tensor loop
    return hw.memory_time(shard * per, launches)


_FOREACH_TENSORS_PER_LAUNCH = 64
"""Tensors one multi-tensor-apply launch covers (torch's limit is 24–110 by the number of tensor lists)."""


def fused_optimizer(runtime: str, hw: Hardware) -> bool:
    """Whether the runtime's AdamW is one fused kernel: Megatron's always; ``shardwise train``'s on GPUs
    (``optimizer.implementation = auto``), not on CPU ranks (where ``auto`` keeps torch's per-tensor loop)."""
    return runtime == "megatron" or hw.kind == "gpu"
