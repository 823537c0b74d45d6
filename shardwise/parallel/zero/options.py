"""``sw.zero``'s options: the stages, the collective algorithm and its default, and the up-front input checks
(every one a ``ValueError``/``TypeError`` naming the value and the fix, before any communication). Pure."""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch

from ...comm.ops import ALGORITHM_CHOICES, SUPPORTED_DTYPES
from ...mesh import Mesh
from ..common.mixed_precision import MixedPrecision
from ..data.replicas import check_module, trainable

__all__ = ["STAGES", "Algorithm", "default_algorithm", "check_inputs"]

STAGES = (1, 2, 3)
Algorithm = Literal["native", "ring", "tree", "shm", "auto"]


def default_algorithm(mesh: Mesh, dtypes: Sequence[torch.dtype]) -> str:
    """ZeRO's collective implementation when ``algorithm=None``: NCCL's own on CUDA; on CPU the ring, which
    beats gloo's native reduce-scatter 2-3x at bucket sizes (0.25-12 MB measured on 2 ranks), unless a
    dtype is one only the backend handles. Pure."""
    if mesh.device.type == "cuda" or any(d not in SUPPORTED_DTYPES for d in dtypes):
        return "native"
    return "ring"


def check_inputs(model: Any, mesh: Mesh, axis: str, stage: Any, bucket_cap_mb: float, first_bucket_mb: float,
                  mixed_precision: Any, algorithm: Any) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {list(STAGES)}, got {stage!r}; 1 shards optimizer state, "
                         f"2 also gradients, 3 also parameters")
    if getattr(model, "_shardwise_zero", False):
        raise ValueError(f"{type(model).__name__} is already wrapped by sw.zero (or is its wrapper); wrap the "
                         f"plain model once")
    check_module(model, mesh, axis)
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0 (megabytes), got {value!r}")
    if algorithm is not None and algorithm not in ALGORITHM_CHOICES:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {list(ALGORITHM_CHOICES)}, or None for "
                         f"the default (ring on CPU, native on CUDA)")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be a shardwise MixedPrecision or None, got "
                        f"{type(mixed_precision).__name__}")
    kinds = {(p.dtype, mesh.device if p.is_meta else p.device) for _, p in trainable(model)}  # meta: built there
    if len(kinds) > 1:
        found = sorted(f"{d} on {dev}" for d, dev in kinds)
        raise ValueError(f"ZeRO flattens all trainable parameters into flat buffers of one dtype on one device, "
                         f"found {found}; convert the model first, e.g. model.to(torch.float32), and use "
                         f"mixed_precision=MixedPrecision(...) for low-precision compute")
