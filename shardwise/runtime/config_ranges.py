"""Range checks of the configuration's real-valued fields (``config.validate`` calls them): each error names the
field, the value and a flag that fixes it. Pure."""

from __future__ import annotations

import math

from .config_schema import Config

__all__ = ["check_numbers"]


def check_numbers(config: Config) -> None:
    """The real-valued fields' ranges (timeout, bucket size, learning rates, clipping)."""
    p, t, o = config.parallel, config.train, config.optimizer
    if not 0 < t.timeout_s <= 3600:
        raise ValueError(f"train.timeout_s = {t.timeout_s} must be in (0, 3600] seconds; e.g. --train.timeout_s 60")
    if not p.bucket_cap_mb > 0:
        raise ValueError(f"parallel.bucket_cap_mb = {p.bucket_cap_mb} must be > 0 (megabytes); e.g. "
                         f"--parallel.bucket_cap_mb 25")
    if not o.lr >= 0:  # 0: the weights stay as loaded (a pretrained round trip, an evaluation run)
        raise ValueError(f"optimizer.lr = {o.lr} must be >= 0; e.g. --optimizer.lr 0.003")
    if not (o.clip_grad_norm >= 0 and math.isfinite(o.clip_grad_norm)):
        raise ValueError(f"optimizer.clip_grad_norm = {o.clip_grad_norm} must be a finite number >= 0 (0: no "
                         f"clipping); e.g. --optimizer.clip_grad_norm 1.0")
    if not 0 <= o.min_lr <= o.lr:
        raise ValueError(f"optimizer.min_lr = {o.min_lr} must be in [0, optimizer.lr = {o.lr}]; e.g. "
                         f"--optimizer.min_lr {o.lr / 10:g}")

