"""``sw.auto``: per-module layouts (data parallel, column, row, vocabulary split) chosen by cost."""

from .choose import auto
from .plan import ParallelizePlan, Plan

__all__ = ["auto", "ParallelizePlan", "Plan"]
