"""The point-to-point segment of one axis group: byte layout and message framing (pure arithmetic).

One segment per (mesh, axis) group, mapped by every member (``shm_p2p.py``)::

    [ header 128 B ][ control: n ranks x 128 B ][ doorbells: n ranks x 128 B ][ channel 0 ] ... [ channel C-1 ]
    channel (i -> j), one per ordered pair i != j:  [ head 128 B ][ tail 128 B ][ ring of R bytes ]

* control line of rank ``r`` (written only by ``r``): ``ABORT`` (1 + the coordinate where a failure started,
  as in ``shm_segment``), ``SLEEP_MAIN`` / ``SLEEP_PUSH`` (non-zero while r's caller thread / its pusher
  thread may sleep on r's doorbell);
* doorbell of rank ``r``: written by r's peers whenever they publish something r may wait for (data in a
  channel towards r, space freed in a channel from r); r sleeps on it with a futex. Every write stores a
  value unique to (writer, write), so a sleeper that read the old value never misses a change;
* ``head`` (written only by producer i): stream bytes published; ``tail`` (written only by consumer j): stream
  bytes consumed. Both only grow; ``head - tail <= R``. Stream position ``x`` lives at ring byte ``x % R``.

A message is a 64-byte header (``nbytes``, ``tag``, per-channel sequence number) followed by its payload;
the next header starts at the next multiple of 64 (``R`` is a multiple of 128, so a header never wraps).
The payload streams through the ring piece by piece when it is larger than the free space.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["P2PLayout", "HEADER", "ABORT", "SLEEP_MAIN", "SLEEP_PUSH", "align", "span", "ring_bytes_for",
           "MIN_RING_BYTES"]

LINE = 128
HEADER = 64
"""Bytes of a message header (also the alignment of a message start)."""
ABORT, SLEEP_MAIN, SLEEP_PUSH = 0, 1, 2
"""Fields of a rank's control line."""
MIN_RING_BYTES = 4096
_BUDGET = 16 << 20
_MAX_RING, _MIN_DEFAULT_RING = 4 << 20, 256 << 10


def align(pos: int) -> int:
    """The first message start at or after stream position ``pos``."""
    return -(-pos // HEADER) * HEADER


def span(nbytes: int) -> int:
    """Stream bytes one message of ``nbytes`` occupies (header, payload, padding to the next start)."""
    return HEADER + align(nbytes)


def ring_bytes_for(n: int) -> int:
    """Default ring bytes per channel for ``n`` ranks: about 16 MiB over all ``n (n-1)`` channels, a power of
    two in [256 KiB, 4 MiB] (4 MiB for 2 ranks, 1 MiB for 4, 256 KiB from 8). Pure."""
    if n < 2:
        return _MIN_DEFAULT_RING
    per, ring = _BUDGET // (n * (n - 1)), _MAX_RING
    while ring > _MIN_DEFAULT_RING and ring > per:
        ring //= 2
    return ring


@dataclass(frozen=True)
class P2PLayout:
    """Offsets inside a point-to-point segment of ``n`` ranks with ``ring_bytes`` per channel. Pure."""

    n: int
    ring_bytes: int

    def __post_init__(self) -> None:
        if self.n < 2:
            raise ValueError(f"a point-to-point segment needs n >= 2 ranks, got n={self.n}")
        if self.ring_bytes < MIN_RING_BYTES or self.ring_bytes % LINE:
            raise ValueError(f"ring_bytes must be a multiple of {LINE} and >= {MIN_RING_BYTES}, got {self.ring_bytes}")

    @property
    def channels(self) -> int:
        return self.n * (self.n - 1)

    @property
    def channel_bytes(self) -> int:
        return 2 * LINE + self.ring_bytes

    @property
    def channels_offset(self) -> int:
        return LINE * (1 + 2 * self.n)

    @property
    def total_bytes(self) -> int:
        return self.channels_offset + self.channels * self.channel_bytes

    def channel(self, src: int, dst: int) -> int:
        """Index of the channel from coordinate ``src`` to coordinate ``dst`` (``src != dst``)."""
        assert 0 <= src < self.n and 0 <= dst < self.n and src != dst, (src, dst)
        return src * (self.n - 1) + (dst if dst < src else dst - 1)

    def control(self, rank: int, field: int) -> int:
        """int64 index of ``rank``'s control ``field``."""
        assert 0 <= rank < self.n and 0 <= field < LINE // 8
        return (LINE * (1 + rank)) // 8 + field

    def bell(self, rank: int) -> int:
        """int64 index of ``rank``'s doorbell."""
        assert 0 <= rank < self.n
        return (LINE * (1 + self.n + rank)) // 8

    def head(self, c: int) -> int:
        """int64 index of channel ``c``'s head (producer's published stream position)."""
        return (self.channels_offset + c * self.channel_bytes) // 8

    def tail(self, c: int) -> int:
        """int64 index of channel ``c``'s tail (consumer's published stream position)."""
        return (self.channels_offset + c * self.channel_bytes + LINE) // 8

    def ring(self, c: int) -> int:
        """Byte offset of channel ``c``'s ring."""
        return self.channels_offset + c * self.channel_bytes + 2 * LINE
