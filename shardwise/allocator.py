"""What the C allocator keeps: glibc's heap retention on CPU ranks, and how ``sw.init`` bounds it.

On a CPU rank tensors live in memory from ``malloc``. glibc serves a request below its *mmap threshold* from a
heap arena and one above it with a private ``mmap``; freeing an ``mmap``-ed block returns it to the system at
once, but heap memory goes back only when the top of the heap is free (``M_TRIM_THRESHOLD``) — a freed block
in the middle stays resident. The threshold also *moves*: each time an ``mmap``-ed block is freed, glibc raises
it to that block's size (up to 32 MiB on 64-bit), so after the first step every activation, gradient and
message buffer of a few MiB comes from the heap, and the holes a training step leaves there (activations freed
in backward while gradients are allocated, a unit gathered and freed) stay resident: a rank holds its peak of
the step plus the fragmentation of every earlier one — measured at about 1.2-1.35× of what its tensors need on
a 302M GPT under ZeRO-3 over 4 CPU ranks (RESULTS, "Memory").

``bound_retention()`` fixes the threshold at ``THRESHOLD_BYTES`` (fixing it also stops the moving) and trims
the heap top at that size: every tensor of 128 KiB or more gets its own mapping and is returned when freed,
so the resident set follows the live tensors. The cost is a page fault per 4 KiB page of each new large
tensor (the kernel zero-fills it): 10-25 % of a CPU step where activations are 0.1-1 MiB each (RESULTS,
"Memory"); CUDA ranks are unaffected (device memory is the caching allocator's). ``sw.init`` calls it on CPU;
``SHARDWISE_MALLOC=keep`` (``env_flag``) leaves glibc's defaults (speed over memory), ``SHARDWISE_MALLOC=BYTES``
sets another threshold. ``retained_bytes()`` says how much free memory the heap holds now (``mallinfo2``), for the ledger.
Nothing here exists on other C libraries (musl, macOS): both functions then do nothing and return 0/False.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import lru_cache

__all__ = ["bound_retention", "retained_bytes", "trim", "THRESHOLD_BYTES"]

THRESHOLD_BYTES = 128 * 1024
"""Requests of this size or more are ``mmap``-ed and unmapped when freed (glibc's own starting threshold)."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # glibc only (musl has no such symbol)
        return libc
    except (OSError, AttributeError):
        return None


def bound_retention(threshold_bytes: int = THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds at ``threshold_bytes`` for this process (see module docstring).
    Returns whether it took effect. Local, idempotent."""
    libc = _glibc()
    if libc is None:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)) == 1
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, int(threshold_bytes)) == 1 and ok)


def retained_bytes() -> int:
    """Free bytes glibc's heap arenas hold (``mallinfo2().fordblks``): resident memory no tensor uses (an upper
    bound: free pages never touched count too). 0 where unknown. Local."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return 0
    libc.mallinfo2.restype = _MallInfo2
    return int(libc.mallinfo2().fordblks)


def trim() -> bool:
    """Give the heap's free pages back to the system (``malloc_trim(0)``). Local; False where unavailable."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))
