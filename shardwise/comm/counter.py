"""``CommCounter``: count collectives, point-to-point messages and bytes, for tests and benchmarks.

Tests assert the communication *pattern* (how many all-reduces per step, how many messages a ring sends),
not only the values. Counting is process-local; open counters receive every record made by any thread of
this process (the asynchronous comm workers included) while they are open.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from types import TracebackType

__all__ = ["CommCounter", "CollectiveRecord", "record_collective", "record_message"]


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective call as the API saw it."""

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``, ``all_to_all``, ``send``, ``recv``."""
    algorithm: str
    axis: str
    nbytes: int
    """Bytes of this rank's input tensor."""
    group_size: int


@dataclass
class CommCounter:
    """Context manager collecting ``CollectiveRecord`` s and point-to-point message counts on this rank.

    >>> with CommCounter() as c:
    ...     all_reduce(t, mesh, "dp", algorithm="ring")
    >>> c.count("all_reduce"), c.messages_sent
    """

    records: list[CollectiveRecord] = field(default_factory=list)
    messages_sent: int = 0
    """Point-to-point messages this rank sent (ring/tree algorithms and ``send``)."""
    bytes_sent: int = 0
    messages_received: int = 0
    bytes_received: int = 0

    def count(self, op: str | None = None, *, axis: str | None = None, algorithm: str | None = None) -> int:
        return sum(1 for r in self.records if (op is None or r.op == op) and (axis is None or r.axis == axis)
                   and (algorithm is None or r.algorithm == algorithm))

    def bytes(self, op: str | None = None, *, axis: str | None = None) -> int:
        return sum(r.nbytes for r in self.records if (op is None or r.op == op) and (axis is None or r.axis == axis))

    def by_op(self) -> dict[str, int]:
        return dict(Counter(r.op for r in self.records))

    def __enter__(self) -> "CommCounter":
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        with _LOCK:
            _ACTIVE.remove(self)


_LOCK = threading.Lock()
_ACTIVE: list[CommCounter] = []


def record_collective(op: str, algorithm: str, axis: str, nbytes: int, group_size: int) -> None:
    if not _ACTIVE:
        return
    rec = CollectiveRecord(op, algorithm, axis, nbytes, group_size)
    with _LOCK:
        for c in _ACTIVE:
            c.records.append(rec)


def record_message(nbytes: int, *, sent: bool) -> None:
    if not _ACTIVE:
        return
    with _LOCK:
        for c in _ACTIVE:
            if sent:
                c.messages_sent += 1
                c.bytes_sent += nbytes
            else:
                c.messages_received += 1
                c.bytes_received += nbytes
