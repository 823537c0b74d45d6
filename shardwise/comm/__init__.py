"""Collectives over mesh axes: native (gloo/NCCL), ring and tree over point-to-point; counting; autograd pairs."""

from .collectives import (all_gather, all_reduce, all_to_all, barrier, broadcast, irecv, isend, recv,
                          reduce_scatter, send)
from . import autograd
from .counter import CollectiveRecord, CommCounter
from .handles import Handle
from .ops import ALGORITHMS, REDUCE_OPS, shard_offsets, shard_sizes

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv", "isend",
           "irecv", "barrier", "CommCounter", "CollectiveRecord", "Handle", "ALGORITHMS", "REDUCE_OPS",
           "shard_sizes", "shard_offsets", "autograd"]
