"""ZeRO stages 1-3 (``sw.zero``): data parallelism whose optimizer state, gradients and parameters are
sharded over the data-parallel axis in flat groups."""

from .wrap import zero

__all__ = ["zero"]
