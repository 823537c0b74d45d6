"""Deprecated: the old home of ``parallelize``'s helpers; import them from ``shardwise`` instead.

``from shardwise.parallel.tensor.api import gpt_plan, vocab_parallel_cross_entropy`` (what the README once taught)
keeps working but warns: write ``sw.gpt_plan`` and ``sw.vocab_parallel_cross_entropy``. The code lives in
``apply_plan.py``; this module only re-exports its old names.
"""

import warnings

from .apply_plan import (ColumnParallel, QKVParallel, RowParallel, SequenceParallel, VocabParallel, full_tensor,
                         global_view, gpt_plan, local_piece, parallelize, split_axes, vocab_parallel_cross_entropy)

__all__ = ["parallelize", "gpt_plan", "vocab_parallel_cross_entropy", "global_view", "split_axes", "full_tensor",
           "local_piece", "ColumnParallel", "RowParallel", "VocabParallel", "QKVParallel", "SequenceParallel"]

warnings.warn("shardwise.parallel.tensor.api is deprecated: use sw.gpt_plan, sw.vocab_parallel_cross_entropy and "
              "sw.parallelize (import shardwise as sw)", DeprecationWarning, stacklevel=2)
