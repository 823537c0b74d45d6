"""``sw.auto``: per-module layouts (data parallel, column, row, vocabulary split) chosen by cost."""

from .api import auto
from .plan import Plan

__all__ = ["auto", "Plan"]
