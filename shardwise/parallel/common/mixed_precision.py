"""Mixed precision for ZeRO: low-precision compute parameters, fp32 master weights, dynamic loss scaling.

With ``MixedPrecision(param_dtype=torch.bfloat16)`` the model computes (forward and backward) with bf16
parameters and gradients — 2 bytes each — while the optimizer updates an fp32 *master* copy of this rank's
shard (4 bytes) with fp32 state (Adam: m and v, 8 bytes): the ``2Ψ + 2Ψ + 12Ψ`` accounting of the ZeRO
paper (Rajbhandari et al., 2020, section 3), sharded per stage. After each step the master shard is cast
back to the compute dtype.

fp16 has a narrow exponent range: small gradients underflow to zero. Dynamic loss scaling (Micikevicius et
al., 2018, "Mixed Precision Training") multiplies the loss by ``S`` before backward (``opt.scale_loss``),
divides the gradients by ``S`` before the update, skips a step whose gradients overflowed (inf/NaN on *any*
rank — one all-reduce of a flag decides it for all) and halves ``S``; after ``growth_interval`` clean steps
``S`` doubles. bf16 has fp32's exponent range and needs no scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecision", "LossScaler"]

_LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Precision policy of ``sw.zero(..., mixed_precision=MixedPrecision(...))``."""

    param_dtype: torch.dtype = torch.bfloat16
    """Dtype of the compute parameters and of the gradients autograd produces (bf16 or fp16)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced (and the gradient shard kept) in; None: ``param_dtype``. fp32 costs
    2 more bytes per sharded gradient element but sums N ranks' gradients without rounding."""
    loss_scale: float | None = None
    """None: dynamic scaling for fp16 and none for bf16; a number: a fixed scale (1.0 = off)."""
    init_scale: float = 2.0**16
    """First scale of dynamic scaling."""
    growth_interval: int = 2000
    """Clean steps before the dynamic scale doubles."""

    def __post_init__(self) -> None:
        if self.param_dtype not in _LOW:
            raise ValueError(f"MixedPrecision.param_dtype must be torch.bfloat16 or torch.float16, got "
                             f"{self.param_dtype}; for fp32 training pass mixed_precision=None")
        if self.reduce_dtype not in (None, torch.float32, *_LOW):
            raise ValueError(f"MixedPrecision.reduce_dtype must be None, torch.float32, torch.bfloat16 or "
                             f"torch.float16, got {self.reduce_dtype}")
        if self.loss_scale is not None and not self.loss_scale > 0:
            raise ValueError(f"MixedPrecision.loss_scale must be > 0 or None (dynamic), got {self.loss_scale}")
        if not self.init_scale > 0 or self.growth_interval < 1:
            raise ValueError(f"need init_scale > 0 and growth_interval >= 1, got {self.init_scale}, "
                             f"{self.growth_interval}")

    @property
    def dynamic(self) -> bool:
        """Whether the loss scale adapts (fp16 without a fixed ``loss_scale``)."""
        return self.loss_scale is None and self.param_dtype == torch.float16


class LossScaler:
    """The current loss scale and its update rule (local; the overflow flag is agreed on by the caller)."""

    def __init__(self, policy: MixedPrecision | None) -> None:
        self.dynamic = policy is not None and policy.dynamic
        if policy is None:
            self.scale = 1.0
        elif policy.loss_scale is not None:
            self.scale = float(policy.loss_scale)
        else:
            self.scale = policy.init_scale if self.dynamic else 1.0
        self.growth_interval = policy.growth_interval if policy is not None else 1
        self._clean = 0
        self.skipped = 0
        """Steps skipped because of overflow so far."""

    def update(self, overflow: bool) -> None:
        """After a step: halve the scale on overflow, double it after ``growth_interval`` clean steps."""
        if overflow:
            self.skipped += 1
        if not self.dynamic:
            return
        if overflow:
            self.scale, self._clean = max(self.scale / 2.0, 1.0), 0
            return
        self._clean += 1
        if self._clean >= self.growth_interval:
            self.scale, self._clean = self.scale * 2.0, 0
