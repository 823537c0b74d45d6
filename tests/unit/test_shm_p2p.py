"""Shared-memory point-to-point without processes: the layout arithmetic, and the link protocol with the
members as threads of this process (each with its own mapping of one segment). A 4 KiB ring forces every
larger message to stream; payloads are compared with the bytes the sender was given."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from shardwise.comm.shm_p2p import ShmLink
from shardwise.comm.shm_p2p_layout import (HEADER, MIN_RING_BYTES, P2PLayout, align, ring_bytes_for, span)
from shardwise.comm.shm_segment import attach_segment, create_segment, unlink_segment
from shardwise.comm.shm_sync import Peer, ShmError, ShmPeerError, WaitPolicy, process_start_time
from shardwise.parallel.pipeline.communication import TRANSPORTS, check_transport

POLICY = WaitPolicy(spin_s=0.0, yield_s=1e-3, check_s=0.01)


def test_layout_regions_are_disjoint_aligned_and_inside():
    for n in (2, 3, 4):
        lay = P2PLayout(n, MIN_RING_BYTES)
        spans = [(0, 128)]  # header line
        spans += [(lay.control(r, 0) * 8, lay.control(r, 0) * 8 + 128) for r in range(n)]
        spans += [(lay.bell(r) * 8, lay.bell(r) * 8 + 128) for r in range(n)]
        chans = {lay.channel(i, j) for i in range(n) for j in range(n) if i != j}
        assert chans == set(range(n * (n - 1)))  # one channel per ordered pair
        for c in chans:
            spans += [(lay.head(c) * 8, lay.head(c) * 8 + 128), (lay.tail(c) * 8, lay.tail(c) * 8 + 128),
                      (lay.ring(c), lay.ring(c) + lay.ring_bytes)]
        spans.sort()
        assert all(a % 128 == 0 for a, _ in spans)
        assert all(b <= a2 for (_, b), (a2, _) in zip(spans, spans[1:]))
        assert spans[-1][1] == lay.total_bytes


def test_framing_and_default_ring_sizes():
    assert [align(x) for x in (0, 1, 63, 64, 65)] == [0, 64, 64, 64, 128]
    assert span(0) == HEADER and span(1) == 2 * HEADER and span(64) == 2 * HEADER and span(65) == 3 * HEADER
    assert [ring_bytes_for(n) for n in (2, 3, 4, 8, 64)] == [4 << 20, 2 << 20, 1 << 20, 256 << 10, 256 << 10]
    with pytest.raises(ValueError, match="multiple of 128"):
        P2PLayout(2, 5000)
    with pytest.raises(ValueError, match="n >= 2"):
        P2PLayout(1, MIN_RING_BYTES)


def test_transport_check_names_the_choices_and_the_device():
    assert TRANSPORTS == ("native", "shm", "auto")
    check_transport("shm", "cpu")
    check_transport("auto", "cuda")
    with pytest.raises(ValueError, match="host memory.*cuda.*transport='native'"):
        check_transport("shm", "cuda")
    with pytest.raises(ValueError, match="one of"):
        check_transport("tcp", "cpu")


def links(n: int, pids: list[int] | None = None, ring: int = MIN_RING_BYTES) -> list[ShmLink]:
    layout = P2PLayout(n, ring)
    first = create_segment(layout)  # type: ignore[arg-type]
    segs = [first] + [attach_segment(first.name, layout) for _ in range(n - 1)]  # type: ignore[arg-type]
    unlink_segment(first.name)
    pids = pids or [os.getpid()] * n
    peers = [Peer(100 + c, c, pid, process_start_time(pid) if pid == os.getpid() else -1)
             for c, pid in enumerate(pids)]
    return [ShmLink(seg, layout, peers, c, "pp", 30.0, POLICY) for c, seg in enumerate(segs)]


def _message(k: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(k)
    size = [1, 7, 64, 65, 4095, 4096, 4097, 20_001, 100_000][k % 9]
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def test_messages_stream_through_a_small_ring_in_order_both_ways():
    a, b = links(2)
    count = 40

    def side(link: ShmLink) -> list[bool]:
        other = 1 - link.me
        bufs = [torch.empty_like(_message(k)) for k in range(count)]
        recvs = [link.irecv(buf, other, tag=k) for k, buf in enumerate(bufs)]
        sends = [link.isend(_message(k), other, tag=k) for k in range(count)]
        for h in reversed(recvs):  # the last first: earlier ones complete on the way
            h.wait()
        for h in sends:
            h.wait()
        return [torch.equal(buf, _message(k)) for k, buf in enumerate(bufs)]

    with ThreadPoolExecutor(2) as pool:
        got = [f.result(timeout=60) for f in [pool.submit(side, x) for x in (a, b)]]
    assert got == [[True] * count] * 2


def test_a_small_send_is_done_when_posted_and_a_receive_copies_only_on_wait():
    a, b = links(2, ring=1 << 16)
    s = a.isend(torch.arange(10.0), 1)
    assert s is not None and s.is_completed()  # copied into the channel: no wait for the receiver
    buf = torch.zeros(10)
    r = b.irecv(buf, 0)
    assert torch.equal(buf, torch.zeros(10))  # posting copies nothing
    r.wait()
    assert torch.equal(buf, torch.arange(10.0))
    assert a.isend(torch.empty(0), 1) is None and b.irecv(torch.empty(0, 3), 0) is None


def test_a_receive_that_does_not_match_the_next_message_is_an_error():
    a, b = links(2, ring=1 << 16)
    a.isend(torch.ones(4), 1, tag=3)
    with pytest.raises(ShmError, match="16 bytes and tag 3, but receive 0 expects 16 bytes and tag 5"):
        b.irecv(torch.empty(4), 0, tag=5).wait()
    with pytest.raises(ShmPeerError, match="unusable"):
        b.irecv(torch.empty(4), 0)


def test_a_dead_peer_ends_a_wait_with_its_name():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    a, _ = links(2, pids=[os.getpid(), gone.pid])
    with pytest.raises(ShmPeerError, match=r"recv from rank 101 on axis 'pp': rank 101 \(coordinate 1"):
        a.irecv(torch.empty(4), 1).wait()
    with pytest.raises(ShmPeerError, match="unusable"):
        a.isend(torch.ones(1), 1)
