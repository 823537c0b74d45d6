"""Ring collectives over point-to-point messages (bandwidth-optimal).

The ring all-reduce of Patarasuk & Yuan (2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations") as used by Baidu's allreduce and NCCL: the flat buffer is cut into ``n`` chunks (the uneven
rule of ``shard_sizes``); a reduce-scatter phase of ``n-1`` steps leaves each rank with one fully reduced
chunk, an all-gather phase of ``n-1`` steps circulates them. Each phase moves ``(n-1)/n`` of the buffer per
rank, so bus bandwidth = algorithm bandwidth · 2(n-1)/n, independent of ``n``.

Every step sends to the right neighbour and receives from the left one at the same time. Each chunk is
further cut into *pieces* (``piece_bytes``) and a piece is forwarded as soon as it has been received (and
reduced), so the transfer of one piece overlaps the reduction of the previous one and the next step starts
before the current one has finished — the ring is a pipeline, not ``n-1`` barriers.

All functions take a flat, contiguous 1-D tensor and are collective over ``link`` (every member calls).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from .ops import reduce_into, shard_offsets
from .p2p import AxisLink, wait_all

__all__ = ["ring_all_reduce", "ring_reduce_scatter", "ring_all_gather", "ring_broadcast", "DEFAULT_PIECE_BYTES"]

DEFAULT_PIECE_BYTES = 64 << 20
"""64 MiB pieces, i.e. no pipelining below 64 MiB chunks. Measured on gloo over loopback (2-core VM): a
point-to-point message costs ~0.25 ms beyond its bytes (gloo's send/receive handshake through its I/O
thread), so 1 MiB pieces made a 64 MiB ring all-reduce 1.5× slower than whole chunks. On a fabric with
cheap messages pass a smaller ``piece_bytes`` to overlap transfer and reduction."""

_SCRATCH_PER_THREAD = 4
"""Scratch buffers kept per thread, one per (dtype, device), least recently used dropped first. A ring runs
one dtype on one device at a time, so 4 covers a job mixing fp32/bf16/fp16 gradients on one device without
reallocating; an extra dtype or device costs one allocation, never unbounded memory."""

_LOCAL = threading.local()
"""Each thread's buffers (``_LOCAL.buffers``): owned by the thread, so they are freed when it ends instead of
piling up under dead thread ids."""


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable receive buffer of at least ``numel`` elements, one per (thread, dtype, device).

    Reusing it avoids first-touch page faults on a fresh multi-MiB allocation every call (measured: a few
    ms per 32 MiB on CPU), which otherwise cost as much as the transfer itself."""
    buffers = _thread_buffers()
    key = (dtype, device)
    buf = buffers.pop(key, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
    buffers[key] = buf  # (re)inserted last: the most recently used
    while len(buffers) > _SCRATCH_PER_THREAD:
        buffers.popitem(last=False)
    return buf[:numel]


def _thread_buffers() -> OrderedDict[tuple[torch.dtype, torch.device], torch.Tensor]:
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = OrderedDict()
    return buffers


def _pieces(lo: int, hi: int, piece: int) -> list[tuple[int, int]]:
    return [(a, min(a + piece, hi)) for a in range(lo, hi, piece)]


def _ring_pass(buf: torch.Tensor, link: AxisLink, offsets: list[int], shift: int, op: str | None,
               piece: int) -> None:
    """``n-1`` pipelined ring steps. At step ``s`` rank ``i`` sends chunk ``(i+shift-s) % n`` to the right
    and receives chunk ``(i+shift-s-1) % n`` from the left; with ``op`` the received chunk is reduced into
    ``buf`` (reduce-scatter phase), without it it is written into ``buf`` (all-gather phase). Whatever
    arrives is forwarded at the next step, piece by piece."""
    n, i = link.size, link.index
    right, left = (i + 1) % n, (i - 1) % n
    max_chunk = max(b - a for a, b in zip(offsets, offsets[1:]))
    recv_buf = scratch(max_chunk if op else 0, buf.dtype, buf.device)
    first = (i + shift) % n
    sends = [link.isend(buf[a:b], right) for a, b in _pieces(offsets[first], offsets[first + 1], piece)]
    for s in range(n - 1):
        c = (i + shift - s - 1) % n
        lo, hi = offsets[c], offsets[c + 1]
        spans = _pieces(lo, hi, piece)
        targets = [recv_buf[a - lo:b - lo] if op else buf[a:b] for a, b in spans]
        recvs = [link.irecv(t, left) for t in targets]
        for (a, b), target, work in zip(spans, targets, recvs):
            if work is not None:
                work.wait()
            if op:
                reduce_into(buf[a:b], target, op)
            if s < n - 2:  # forward what just arrived: it is what the right neighbour needs next
                sends.append(link.isend(buf[a:b], right))
    wait_all(sends)


def ring_all_reduce(buf: torch.Tensor, link: AxisLink, op: str, piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
    """In-place all-reduce of ``buf``: reduce-scatter ring, then all-gather ring (2(n-1) steps)."""
    n = link.size
    if n == 1:
        return
    offsets = shard_offsets(buf.numel(), n)
    piece = max(1, piece_bytes // buf.element_size())
    _ring_pass(buf, link, offsets, shift=0, op=op, piece=piece)
    # After the reduce-scatter phase rank i owns the reduced chunk (i+1) % n.
    if op == "avg":
        own = (link.index + 1) % n
        buf[offsets[own]:offsets[own + 1]].div_(n)
    _ring_pass(buf, link, offsets, shift=1, op=None, piece=piece)


def ring_reduce_scatter(buf: torch.Tensor, link: AxisLink, op: str, offsets: list[int],
                        piece_bytes: int = DEFAULT_PIECE_BYTES) -> torch.Tensor:
    """Reduce ``buf`` (clobbered as scratch) across the group; return this rank's chunk
    ``buf[offsets[index]:offsets[index+1]]`` (a view)."""
    n, i = link.size, link.index
    if n > 1:
        # shift=-1 makes the last chunk each rank receives (and finishes reducing) its own chunk i.
        _ring_pass(buf, link, offsets, shift=-1, op=op, piece=max(1, piece_bytes // buf.element_size()))
    out = buf[offsets[i]:offsets[i + 1]]
    if op == "avg":
        out.div_(n)
    return out


def ring_all_gather(out: torch.Tensor, link: AxisLink, offsets: list[int],
                    piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
    """``out`` holds this rank's chunk at ``offsets[index]:offsets[index+1]``; fill in everyone else's."""
    if link.size > 1:
        _ring_pass(out, link, offsets, shift=0, op=None, piece=max(1, piece_bytes // out.element_size()))


def ring_broadcast(buf: torch.Tensor, link: AxisLink, root: int, piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
    """Pipelined chain broadcast from group position ``root``: each rank forwards every piece to the next."""
    n = link.size
    if n == 1:
        return
    v = (link.index - root) % n  # position along the chain that starts at the root
    nxt, prev = (link.index + 1) % n, (link.index - 1) % n
    spans = _pieces(0, buf.numel(), max(1, piece_bytes // buf.element_size()))
    recvs = [link.irecv(buf[a:b], prev) for a, b in spans] if v > 0 else [None] * len(spans)
    sends = []
    for (a, b), work in zip(spans, recvs):
        if work is not None:
            work.wait()
        if v < n - 1:
            sends.append(link.isend(buf[a:b], nxt))
    wait_all(sends)
