"""Shared vocabulary of the collectives: reduce ops, algorithms, dtypes, and the uneven-split rule."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist

__all__ = ["ReduceOp", "Algorithm", "REDUCE_OPS", "ALGORITHMS", "ALGORITHM_CHOICES", "SUPPORTED_DTYPES",
           "shard_sizes", "shard_offsets", "check_op", "check_algorithm", "check_dtype", "reduce_into",
           "gather_into_tensor", "reduce_scatter_into_tensor"]

ReduceOp = Literal["sum", "avg", "max", "min"]
Algorithm = Literal["native", "ring", "tree", "shm", "auto"]
REDUCE_OPS: tuple[str, ...] = ("sum", "avg", "max", "min")
ALGORITHMS: tuple[str, ...] = ("native", "ring", "tree", "shm")
"""The implementations (what a call finally runs, what ``shardwise bench comm`` measures). ``shm`` (shared
memory, ``shm.py``) needs every rank of the axis group on one host and tensors in host memory."""
ALGORITHM_CHOICES: tuple[str, ...] = (*ALGORITHMS, "auto")
"""What the collectives accept: an implementation, or ``auto`` — the cheapest by the mesh's calibration
(``auto.py``), ``native`` without one."""
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8)


# torch >= 2.13 names the single-tensor all-gather / reduce-scatter ``*_single`` and warns (FutureWarning) on the
# older ``all_gather_into_tensor`` / ``reduce_scatter_tensor``; torch 2.4 has only the older names. Same arguments.
gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``dist.all_gather_single(out, in, group=, async_op=)`` where torch has it, else ``all_gather_into_tensor``."""
reduce_scatter_into_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
"""``dist.reduce_scatter_single(out, in, op=, group=, async_op=)`` where torch has it, else ``reduce_scatter_tensor``."""


def shard_sizes(length: int, parts: int) -> list[int]:
    """The one uneven-split rule used everywhere (collectives, SBP splits, ZeRO shards):
    ``length`` is cut into ``parts`` contiguous pieces and the first ``length % parts`` pieces get one extra
    element. ``shard_sizes(10, 4) == [3, 3, 2, 2]``; ``shard_sizes(1, 3) == [1, 0, 0]``."""
    if parts < 1:
        raise ValueError(f"cannot split into {parts} parts; need at least 1")
    base, extra = divmod(length, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_offsets(length: int, parts: int) -> list[int]:
    """Start offset of every piece of ``shard_sizes(length, parts)``, plus ``length`` at the end."""
    offsets = [0]
    for size in shard_sizes(length, parts):
        offsets.append(offsets[-1] + size)
    return offsets


def check_op(op: str, dtype: torch.dtype) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; choose one of {list(REDUCE_OPS)}")
    if op == "avg" and not dtype.is_floating_point:
        raise ValueError(f"op 'avg' needs a floating dtype, got {dtype}; use op='sum' and divide, "
                         f"or cast to a floating dtype first")


def check_algorithm(algorithm: str, available: tuple[str, ...], collective: str) -> None:
    if algorithm not in available:
        raise ValueError(f"algorithm {algorithm!r} is not available for {collective}; "
                         f"choose one of {list(available)}")


def check_dtype(dtype: torch.dtype, algorithm: str) -> None:
    if algorithm != "native" and dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by the {algorithm!r} algorithm; supported: "
                         f"{[str(d) for d in SUPPORTED_DTYPES]}; cast first or use algorithm='native'")


def reduce_into(dst: torch.Tensor, src: torch.Tensor, op: str) -> None:
    """``dst = dst (op) src`` elementwise, in place; ``avg`` accumulates a sum (divided once at the end)."""
    if op in ("sum", "avg"):
        dst.add_(src)
    elif op == "max":
        torch.maximum(dst, src, out=dst)
    elif op == "min":
        torch.minimum(dst, src, out=dst)
    else:  # pragma: no cover - validated before
        raise AssertionError(op)
