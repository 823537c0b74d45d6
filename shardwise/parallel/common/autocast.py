"""Autocast compute: forward and loss under ``torch.autocast`` in a low-precision dtype, while parameters,
gradients and optimizer state stay fp32 (the fp32 parameters *are* the master weights).

This is the other mixed-precision scheme next to ``mixed_precision.MixedPrecision`` (ZeRO's bf16/fp16 compute
*parameters* with a separate fp32 master copy): autocast keeps no second copy of the weights; each op on
autocast's lower-precision list (matmuls, linear, attention) casts its inputs to bf16 on the fly, ops on its
fp32 list (cross-entropy) run in fp32, and autograd casts each gradient back to its leaf's fp32 dtype. bf16
has fp32's exponent range, so no loss scaling is needed; fp16 would, and is not offered here.

One helper for every code path, so the data-parallel/ZeRO/tensor-parallel loop (``runtime/strategy``) and the
pipeline's forward action (``pipeline/executor.py``) enter exactly the same context. Backward is not wrapped:
autograd replays each op in the dtype its forward used, and ``torch.utils.checkpoint`` (non-reentrant)
restores the forward's autocast state when it recomputes.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["PRECISIONS", "AUTOCAST_DTYPES", "precision_dtype", "compute_autocast", "check_autocast"]

PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "bf16-mixed": None}
"""``train.precision`` -> the autocast dtype (``None``: no autocast: plain fp32, or ``bf16-mixed``'s bf16 weights —
``mixed_precision.MixedPrecision`` inside ZeRO, which needs no autocast)."""

AUTOCAST_DTYPES = (torch.bfloat16,)
"""Dtypes ``compute_autocast`` accepts: bf16 only (fp16 would need a loss scaler to keep small gradients)."""


def precision_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a precision name (``"fp32"`` -> None, ``"bf16"`` -> ``torch.bfloat16``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not allowed; choose one of {list(PRECISIONS)}")
    return PRECISIONS[precision]


def check_autocast(dtype: object) -> None:
    """``ValueError`` unless ``dtype`` is None or one of ``AUTOCAST_DTYPES`` (pure)."""
    if dtype is not None and dtype not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be None (fp32) or torch.bfloat16, got {dtype!r}; fp16 needs loss "
                         f"scaling, use sw.zero(mixed_precision=sw.MixedPrecision(param_dtype=torch.float16))")


def compute_autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager[object]:
    """``torch.autocast`` on ``device``'s type (``cuda``, ``cpu``) in ``dtype``; a no-op context for None."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
