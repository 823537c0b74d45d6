"""One kind of link between devices (its own module so calibration loading needs no ``Hardware``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Link"]


@dataclass(frozen=True)
class Link:
    """One kind of link: a per-step latency and the bus bandwidth one device gets through it."""

    alpha_s: float
    """Latency of one message step (seconds)."""
    bus_bandwidth_Bps: float
    """Achieved bus bandwidth per device (bytes/s), nccl-tests convention."""

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and self.bus_bandwidth_Bps > 0):
            raise ValueError(f"Link needs alpha_s >= 0 and bus_bandwidth_Bps > 0, got {self}")
