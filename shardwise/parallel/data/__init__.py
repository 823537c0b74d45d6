"""Data parallelism: ``DataParallel`` (bucketed gradient all-reduce overlapped with backward, ``no_sync``
accumulation), its reducer and communication hooks, parameter averaging (local SGD) and the single-process
centralized baseline."""

from .data_parallel import DataParallel

__all__ = ["DataParallel"]
