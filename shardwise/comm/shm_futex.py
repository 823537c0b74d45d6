"""Sleeping on a shared counter and waking its sleepers: Linux futexes on the segment's memory (ctypes).

A rank that has waited past its spin/yield phases sleeps *in the kernel* on the 32-bit low half of the
counter it waits for (``FUTEX_WAIT`` returns at once if the word already changed), and a rank that publishes
a counter some peer sleeps on wakes it (``FUTEX_WAKE``). Unlike a timed ``sleep``, a woken rank runs as soon
as the scheduler can (wake-up preemption), and unlike ``sched_yield`` a waiting rank costs no CPU at all —
which matters when ranks outnumber cores or other processes load the machine. Sleeps are bounded by a
timeout, so a missed wake-up (a publisher that looked at the sleeper flag a moment before it was set)
costs at most that timeout, never a hang. ctypes releases the GIL during the call.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["FUTEX_AVAILABLE", "futex_wait", "futex_wake"]

_SYS_FUTEX = {"x86_64": 202, "AMD64": 202, "amd64": 202}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared (not PRIVATE): the word lives in memory mapped by several processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _syscall() -> "ctypes._CFuncPtr | None":
    if not sys.platform.startswith("linux") or _SYS_FUTEX is None:
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int]
    return fn


_CALL = _syscall()
FUTEX_AVAILABLE = _CALL is not None
"""Whether this platform has futexes (Linux x86-64); elsewhere waits fall back to timed sleeps."""


def futex_wait(addr: int, expected: int, timeout_s: float) -> None:
    """Sleep until woken, ``timeout_s`` passes, or the 32-bit word at ``addr`` differs from ``expected``'s low
    32 bits (checked atomically by the kernel). Spurious returns are fine: callers re-check their condition."""
    assert _CALL is not None
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _CALL(_SYS_FUTEX, addr, _FUTEX_WAIT, ctypes.c_int32(expected & 0xFFFFFFFF).value, ctypes.byref(ts), None, 0)


def futex_wake(addr: int) -> None:
    """Wake every process sleeping on the word at ``addr``."""
    assert _CALL is not None
    _CALL(_SYS_FUTEX, addr, _FUTEX_WAKE, 0x7FFFFFFF, None, None, 0)
