"""The shared-memory segment of one axis group: its layout (pure arithmetic) and the file behind it.

One segment per (mesh, axis) group, mapped by every member::

    [ header 128 B ][ counters: n ranks x 128 B ][ slot 0 ][ slot 1 ] ... [ slot K-1 ]
    slot s = (n + 1) regions of R bytes: region r (r < n) is written only by the rank at coordinate r,
             region n holds all-reduce results (written by every reducer, one disjoint sub-range each)

Each rank owns one 128-byte line of counters (``ARRIVE``, ``REDUCED``, ``DONE``, ``ABORT``, ``SLEEP``) that only it
writes, so polling peers never contend for a line another rank writes (two 64-byte lines: no false sharing
with the adjacent-line prefetcher either). Counters are int64 and only grow (``2^63`` pieces never wrap).

The file lives in ``/dev/shm`` (tmpfs) under a random name, is fully allocated up front
(``posix_fallocate``: a full tmpfs is an error here, not a ``SIGBUS`` mid-collective) and is unlinked as soon
as every member has mapped it, so a crash leaves nothing behind.
"""

from __future__ import annotations

import mmap
import os
import secrets
from dataclasses import dataclass

__all__ = ["SegmentLayout", "Segment", "create_segment", "attach_segment", "unlink_segment", "SHM_DIR",
           "NAME_PREFIX", "ARRIVE", "REDUCED", "DONE", "ABORT", "SLEEP", "FIELDS"]

SHM_DIR = "/dev/shm"
NAME_PREFIX = "shardwise-"
MAGIC = 0x5348_4D57_5331  # "SHMWS1": a mapped file that is not ours (or of another version) is refused
LINE = 128
"""Bytes per header line and per rank's counter line; region sizes are multiples of it (aligned views)."""
ARRIVE, REDUCED, DONE, ABORT, SLEEP = 0, 1, 2, 3, 4
FIELDS = 5
"""Counter fields of a rank's line: pieces deposited, pieces reduced, pieces finished; ABORT is non-zero
once the rank left a collective with an error (its peers stop waiting for it): 1 + the coordinate of the
rank where the failure started (itself, or a peer it saw die or fail). SLEEP is non-zero while the rank
sleeps on a peer's counter: 1 + that counter's int64 index (its publisher wakes it, ``shm_futex``)."""


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets inside a segment for ``n`` ranks, ``slots`` slots of ``(n + 1)`` regions of
    ``region_bytes``. Pure."""

    n: int
    slots: int
    region_bytes: int

    def __post_init__(self) -> None:
        if self.n < 1 or self.slots < 1:
            raise ValueError(f"a segment needs n >= 1 ranks and >= 1 slots, got n={self.n}, slots={self.slots}")
        if self.region_bytes < LINE or self.region_bytes % LINE:
            raise ValueError(f"region_bytes must be a positive multiple of {LINE}, got {self.region_bytes}")

    @property
    def counters_offset(self) -> int:
        return LINE

    @property
    def data_offset(self) -> int:
        return LINE + self.n * LINE

    @property
    def slot_bytes(self) -> int:
        return (self.n + 1) * self.region_bytes

    @property
    def total_bytes(self) -> int:
        return self.data_offset + self.slots * self.slot_bytes

    def counter_index(self, rank: int, field: int) -> int:
        """Index of ``(rank, field)`` in the segment viewed as int64 (``memoryview.cast("q")``)."""
        assert 0 <= rank < self.n and 0 <= field < LINE // 8
        return (self.counters_offset + rank * LINE) // 8 + field

    def region_offset(self, slot: int, region: int) -> int:
        """Byte offset of ``region`` (``0..n-1``: a rank's deposit, ``n``: the results) of ``slot``."""
        assert 0 <= slot < self.slots and 0 <= region <= self.n
        return self.data_offset + slot * self.slot_bytes + region * self.region_bytes


@dataclass
class Segment:
    """A mapped segment: ``buf`` (the ``mmap``), its name and layout. Counter access goes through ``words``
    (the mapping as int64; an aligned 8-byte load or store is a single instruction on x86-64, and x86's
    total store order keeps a rank's data stores visible before the counter store that publishes them)."""

    name: str
    layout: SegmentLayout
    buf: mmap.mmap

    def __post_init__(self) -> None:
        self.words = memoryview(self.buf).cast("q")

    def read(self, rank: int, field: int) -> int:
        return self.words[self.layout.counter_index(rank, field)]

    def write(self, rank: int, field: int, value: int) -> None:
        self.words[self.layout.counter_index(rank, field)] = value


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def new_name() -> str:
    """A fresh random segment name (64 random bits: collisions between concurrent jobs are negligible)."""
    return f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def create_segment(layout: SegmentLayout) -> Segment:
    """Create, fully allocate, map and initialise a new segment (zeroed counters). ``OSError`` (e.g. ENOSPC
    when ``/dev/shm`` is too small) leaves no file behind."""
    name = new_name()
    fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, layout.total_bytes)
        buf = mmap.mmap(fd, layout.total_bytes)
    except BaseException:
        os.close(fd)
        unlink_segment(name)
        raise
    os.close(fd)  # the mapping keeps the memory alive
    seg = Segment(name, layout, buf)
    seg.words[0], seg.words[1] = MAGIC, layout.n
    return seg


def attach_segment(name: str, layout: SegmentLayout) -> Segment:
    """Map an existing segment created by a peer with the same ``layout``; ``ValueError`` if it does not match."""
    if not name.startswith(NAME_PREFIX) or "/" in name:
        raise ValueError(f"{name!r} is not a shardwise shared-memory segment name")
    fd = os.open(_path(name), os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        if size != layout.total_bytes:
            raise ValueError(f"shared-memory segment {name} has {size} bytes, expected {layout.total_bytes}")
        buf = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    seg = Segment(name, layout, buf)
    if seg.words[0] != MAGIC or seg.words[1] != layout.n:
        raise ValueError(f"shared-memory segment {name} is not a shardwise segment for {layout.n} ranks")
    return seg


def unlink_segment(name: str) -> None:
    """Remove the segment's file (mappings stay valid); a missing file is fine."""
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass
