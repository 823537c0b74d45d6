"""Collectives over mesh axes: native (gloo/NCCL), ring and tree over point-to-point; counting; autograd pairs;
fitted collective costs (``load_calibration``, ``load_hardware_calibration``) and the choice ``algorithm="auto"``
makes from them (``choose_algorithm``)."""

from .collectives import (all_gather, all_reduce, all_to_all, barrier, broadcast, irecv, isend, recv,
                          reduce_scatter, send)
from . import autograd
from .counter import CollectiveRecord, CommCounter
from .handles import Handle
from .ops import ALGORITHMS, REDUCE_OPS, shard_offsets, shard_sizes
from .calibration import Calibration, load_calibration
from .auto import choose_algorithm
from .hardware import hardware_collectives, load_hardware_calibration
from .alltoall import A2A_ALGORITHMS, all_to_all_autograd, all_to_all_single, exchange_counts

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv", "isend",
           "irecv", "barrier", "CommCounter", "CollectiveRecord", "Handle", "ALGORITHMS", "REDUCE_OPS",
           "shard_sizes", "shard_offsets", "autograd",
           # fitted collective costs (``shardwise calibrate``) and what ``algorithm="auto"`` picks from them
           "Calibration", "load_calibration", "choose_algorithm", "load_hardware_calibration", "hardware_collectives",
           # the uneven all-to-all (native or pairwise), its counts-first exchange and its autograd form
           "all_to_all_single", "exchange_counts", "all_to_all_autograd", "A2A_ALGORITHMS"]
