"""Tensor (model) parallelism: ``sw.parallelize`` applies column/row/vocab/QKV/sequence-parallel styles from a
declarative plan (module-name pattern → style)."""

from .apply_plan import (ColumnParallel, ContextParallel, QKVParallel, RowParallel, SequenceParallel, VocabParallel,
                         parallelize)

__all__ = ["parallelize", "ColumnParallel", "RowParallel", "VocabParallel", "QKVParallel", "SequenceParallel",
           "ContextParallel"]
