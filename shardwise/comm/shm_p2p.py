"""Point-to-point messages through shared memory for axis groups on one host: ``ShmLink``.

The same protocol as ``p2p.AxisLink`` (``isend(t, to, tag)`` / ``irecv(t, frm, tag)`` return an object with
``wait()`` and ``is_completed()``, or ``None`` for an empty tensor; contiguous CPU tensors of any dtype, moved
as raw bytes), over one segment per (mesh, axis) group with a single-producer/single-consumer channel per
ordered pair of ranks (``shm_p2p_layout``).

Matching: messages of one ordered pair arrive in send order (FIFO), and a receive takes the next message
from its sender. Tags are not used to match: the header carries the tag and size, and a receive whose tag or
size differ from the next message's is an error (``ShmError`` naming both), never a silent mix-up. Callers
therefore post their receives from one sender in that sender's send order, which the pipeline executor does
(``parallel/pipeline/communication.py``).

Progress without a spinning thread:

* ``isend`` copies the message into the channel and returns a completed handle when it fits in the free
  space (the common case: the caller never waits for the receiver). Otherwise it copies what fits and hands
  the rest to this link's *pusher* thread, which streams it piece by piece as the receiver frees space and
  sleeps on this rank's doorbell (a futex) in between — it costs no core while it waits, and it makes
  progress even while the caller computes or waits in another collective (so a large send never needs the
  sender's own thread). Later sends to the same peer queue behind it (FIFO).
* ``irecv`` only queues the receive (no copy). Data is copied out of the channel by the caller's thread in
  ``wait()`` / ``is_completed()`` of any receive (earlier receives from the same sender first), so a rank
  that waits for anything drains every channel towards it: two neighbours that send large messages to each
  other at once both make progress (each one's receiver drains while its pusher fills).

Waiting spins briefly, yields, then sleeps on the doorbell, like ``shm_sync``; every ``check_s`` it checks the
peers (``Waiter.check``): a dead peer or one that aborted raises ``ShmPeerError`` naming it, a wait past the
group's timeout ``ShmTimeoutError``. A failure marks the link unusable and raises this rank's ``ABORT`` flag.
One caller thread per link (the pipeline's); the pusher thread is internal.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import weakref
from collections import deque
from typing import Sequence

import torch

from ..mesh import Mesh
from ..world import on_teardown
from .counter import record_message
from .shm_futex import FUTEX_AVAILABLE, futex_wait, futex_wake
from .shm_p2p_layout import ABORT, HEADER, SLEEP_MAIN, SLEEP_PUSH, P2PLayout, align, ring_bytes_for
from .shm_rendezvous import attach_group_segment, cores, group_timeout_s
from .shm_segment import Segment
from .shm_sync import Peer, ShmError, ShmPeerError, Waiter, WaitPolicy, policy_for

__all__ = ["ShmLink", "ShmSend", "ShmRecv", "shm_link_for"]


def shm_link_for(mesh: Mesh, axis: str, *, required: bool = True, ring_bytes: int | None = None,
                 what: str = "shm point-to-point", fix: str = "use the native transport") -> "ShmLink | None":
    """This rank's ``ShmLink`` for ``axis`` (``None`` for a group of one). When the group's ranks are not all
    on one host (or the machine is not x86-64): ``ValueError`` (``what`` cannot run; ``fix``) if ``required``,
    else ``None``. ``ring_bytes``: per channel (default ``ring_bytes_for(n)``). Collective over the axis on the
    first call for a (mesh, axis, ring_bytes); cached on the mesh afterwards."""
    n = mesh.size(axis)
    ring = ring_bytes_for(n) if ring_bytes is None else ring_bytes
    cache: dict[tuple[str, int], ShmLink | str | None] = mesh.__dict__.setdefault("_shm_links", {})
    key = (axis, ring)
    if key not in cache:
        cache[key] = None if n == 1 else _rendezvous(mesh, axis, P2PLayout(n, ring), what, fix)
    entry = cache[key]
    if isinstance(entry, str):
        if required:
            raise ValueError(entry)
        return None
    return entry


def _rendezvous(mesh: Mesh, axis: str, layout: P2PLayout, what: str, fix: str) -> "ShmLink | str":
    made = attach_group_segment(mesh, axis, layout, fix=fix, what=what)
    if isinstance(made, str):
        return made
    seg, peers = made
    return ShmLink(seg, layout, peers, mesh.coord(axis), axis, group_timeout_s(mesh, axis),
                   policy_for(layout.n, cores()))


class _Op:
    """One message in flight: the tensor (kept alive), its address and size, and progress."""

    def __init__(self, link: "ShmLink", t: torch.Tensor, peer: int, tag: int) -> None:
        self.link, self.t, self.peer, self.tag = link, t, peer, tag
        self.addr, self.nbytes = t.data_ptr(), t.numel() * t.element_size()
        self.moved = 0
        """Payload bytes copied so far."""
        self.started = False
        """Header written (send) or read and checked (receive)."""
        self.done = False

    def wait(self) -> None:
        if not self.done:
            self.link._wait(self)

    def is_completed(self) -> bool:
        return self.done


class ShmSend(_Op):
    """Handle of ``ShmLink.isend``: done once every byte is in the channel (not necessarily received)."""


class ShmRecv(_Op):
    """Handle of ``ShmLink.irecv``: done once every byte is in the receive tensor."""

    def is_completed(self) -> bool:
        if not self.done:
            self.link._drain()
        return self.done


class ShmLink:
    """This rank's point-to-point view of an axis group's shared segment. Built by ``shm_link_for``."""

    def __init__(self, seg: Segment, layout: P2PLayout, peers: Sequence[Peer], me: int, axis: str,
                 timeout_s: float, policy: WaitPolicy = WaitPolicy()) -> None:
        self.seg, self.layout, self.n, self.me, self.axis = seg, layout, layout.n, me, axis
        self.ranks = tuple(q.rank for q in peers)
        self.name = seg.name
        self.words = seg.words
        self.addr = torch.frombuffer(seg.buf, dtype=torch.uint8).data_ptr()
        self.policy = policy
        aborts = [layout.control(c, ABORT) for c in range(self.n)]
        self.waiter = Waiter(seg.words, [aborts], peers, me, policy, timeout_s, axis, 0)
        self.ring = layout.ring_bytes
        # per peer: my sends' stream position (head) and my receives' (tail); FIFO queues of unfinished ops
        self._head = {c: 0 for c in range(self.n) if c != me}
        self._tail = dict(self._head)
        self._seq_out, self._seq_in = dict(self._head), dict(self._head)
        self._sends: dict[int, deque[ShmSend]] = {c: deque() for c in self._head}
        self._recvs: dict[int, deque[ShmRecv]] = {c: deque() for c in self._head}
        self._bells = [0, 0]  # doorbell writes by the caller thread / the pusher
        self._work = threading.Event()
        self._pusher: threading.Thread | None = None
        self._stopping = False
        self.broken: str | None = None
        self._error: BaseException | None = None

    @property
    def size(self) -> int:
        return self.n

    @property
    def index(self) -> int:
        return self.me

    # -- the AxisLink protocol -----------------------------------------------------------------------
    def isend(self, t: torch.Tensor, to: int, tag: int = 0) -> ShmSend | None:
        """Start sending ``t`` (contiguous, host memory) to coordinate ``to``; ``None`` for an empty tensor.
        Returns done when the message fitted in the channel; ``t`` must not change until ``wait()``."""
        if t.numel() == 0:
            return None
        self._check_args(t, to, "send to")
        record_message(t.numel() * t.element_size(), sent=True)
        op = ShmSend(self, t, to, tag)
        queue = self._sends[to]
        if not queue:  # the pusher does not touch this channel: copy in on the caller's thread
            self._guard(lambda: self._push(op, 0))
            if op.done:
                return op
        queue.append(op)
        self._start_pusher()
        self._work.set()
        self._ring(self.me, 0)  # a pusher asleep on the doorbell (streaming to another peer) takes it up now
        return op

    def irecv(self, t: torch.Tensor, frm: int, tag: int = 0) -> ShmRecv | None:
        """Queue a receive into ``t`` (contiguous, host memory) of the next message from coordinate ``frm``;
        ``None`` for an empty tensor. Nothing is copied until ``wait()`` / ``is_completed()``."""
        if t.numel() == 0:
            return None
        self._check_args(t, frm, "receive from")
        record_message(t.numel() * t.element_size(), sent=False)
        op = ShmRecv(self, t, frm, tag)
        self._recvs[frm].append(op)
        return op

    def _check_args(self, t: torch.Tensor, peer: int, what: str) -> None:
        if self.broken is not None:
            raise ShmPeerError(f"shm p2p on axis {self.axis!r}: this link is unusable after an earlier failure "
                               f"({self.broken}); restart all ranks")
        if not (0 <= peer < self.n) or peer == self.me:
            raise ValueError(f"shm p2p on axis {self.axis!r}: cannot {what} coordinate {peer} (this rank is "
                             f"coordinate {self.me} of {self.n}); pass another member's coordinate")
        if t.device.type != "cpu" or not t.is_contiguous():
            layout = "contiguous" if t.is_contiguous() else "non-contiguous"
            raise ValueError(f"shm p2p moves contiguous host memory, got a {layout} tensor on {t.device}; pass "
                             f"t.contiguous() on the CPU (or use the native transport)")

    # -- copies ----------------------------------------------------------------------------------------
    def _push(self, op: ShmSend, who: int) -> bool:
        """Copy as much of ``op`` into its channel as fits; publish and ring the receiver. Whether any
        byte moved. ``who``: 0 the caller thread, 1 the pusher."""
        lay, words, ring, peer = self.layout, self.words, self.ring, op.peer
        c = lay.channel(self.me, peer)
        head = self._head[peer]
        free = ring - (head - words[lay.tail(c)])
        moved = False
        if not op.started:
            head = align(head)
            free = ring - (head - words[lay.tail(c)])
            if free < HEADER:
                return False
            k = (lay.ring(c) + head % ring) // 8
            words[k], words[k + 1], words[k + 2] = op.nbytes, op.tag, self._seq_out[peer]
            self._seq_out[peer] += 1
            head, free, op.started, moved = head + HEADER, free - HEADER, True, True
        base = self.addr + lay.ring(c)
        while op.moved < op.nbytes and free > 0:
            pos = head % ring
            k = min(free, op.nbytes - op.moved, ring - pos)
            ctypes.memmove(base + pos, op.addr + op.moved, k)
            op.moved, head, free, moved = op.moved + k, head + k, free - k, True
        if moved:
            self._head[peer] = head
            words[lay.head(c)] = head  # after the data stores: x86 keeps their order (see shm_rendezvous)
            self._ring(peer, who)
        if op.moved == op.nbytes:
            op.done = True
            op.t = None  # type: ignore[assignment]  # the bytes are in the channel: release the tensor
        return moved

    def _pull(self, op: ShmRecv) -> bool:
        """Copy what has arrived of ``op`` (the oldest receive from its sender) out of the channel."""
        lay, words, ring, peer = self.layout, self.words, self.ring, op.peer
        c = lay.channel(peer, self.me)
        tail, head = self._tail[peer], words[lay.head(c)]
        moved = False
        if not op.started:
            if head - tail < HEADER:
                return False
            k = (lay.ring(c) + tail % ring) // 8
            nbytes, tag, seq = words[k], words[k + 1], words[k + 2]
            if nbytes != op.nbytes or tag != op.tag or seq != self._seq_in[peer]:
                raise ShmError(f"shm p2p on axis {self.axis!r}: message {seq} from rank {self.ranks[peer]} has "
                               f"{nbytes} bytes and tag {tag}, but receive {self._seq_in[peer]} expects {op.nbytes} "
                               f"bytes and tag {op.tag}; post receives from one sender in its send order "
                               f"(messages of one pair are matched in order)")
            self._seq_in[peer] += 1
            tail, op.started, moved = tail + HEADER, True, True
        base = self.addr + lay.ring(c)
        while op.moved < op.nbytes and head > tail:
            pos = tail % ring
            k = min(head - tail, op.nbytes - op.moved, ring - pos)
            ctypes.memmove(op.addr + op.moved, base + pos, k)
            op.moved, tail, moved = op.moved + k, tail + k, True
        if op.moved == op.nbytes:
            tail, op.done = align(tail), True
        if moved:
            self._tail[peer] = tail
            words[lay.tail(c)] = tail  # the sender may now overwrite what we copied out
            self._ring(peer, 0)
        return moved

    def _ring(self, peer: int, who: int) -> None:
        """Tell ``peer`` something changed: a fresh value in its doorbell, and a futex wake if it may sleep."""
        lay, words = self.layout, self.words
        self._bells[who] += 1
        k = lay.bell(peer)
        words[k] = ((self._bells[who] * 2 + who) * self.n + self.me) & 0x7FFFFFFF  # unique per (writer, write)
        if FUTEX_AVAILABLE and (words[lay.control(peer, SLEEP_MAIN)] or words[lay.control(peer, SLEEP_PUSH)]):
            futex_wake(self.addr + 8 * k)

    def _drain(self) -> bool:
        """Copy out everything that has arrived for posted receives, in each sender's order."""
        moved = False
        for queue in self._recvs.values():
            while queue:
                op = queue[0]
                moved |= self._guard(lambda: self._pull(op))
                if not op.done:
                    break
                queue.popleft()
        return moved

    # -- waiting -------------------------------------------------------------------------------------
    def _wait(self, op: _Op) -> None:
        """Drain receives (and let the pusher fill sends) until ``op`` is done; never forever."""
        self._guard(lambda: self._wait_loop(op))

    def _wait_loop(self, op: _Op) -> None:
        p, words, bell = self.policy, self.words, self.layout.bell(self.me)
        start = time.perf_counter()
        next_check = start + p.check_s
        while True:
            seen = words[bell]
            if self._drain():
                start = time.perf_counter()
            if op.done:
                return
            if self._error is not None:  # the pusher failed: the same error, raised on the caller's thread
                raise ShmPeerError(str(self._error), getattr(self._error, "culprit", None))
            now = time.perf_counter()
            if now >= next_check:
                what = "send to" if isinstance(op, ShmSend) else "recv from"
                self.waiter.check([op.peer], f"{what} rank {self.ranks[op.peer]}", now - start)
                next_check = now + p.check_s
            if now - start < p.spin_s:
                continue
            if now - start < p.yield_s:
                os.sched_yield()
            else:
                self._sleep(SLEEP_MAIN, seen)

    def _sleep(self, field: int, seen: int) -> None:
        """Sleep until this rank's doorbell differs from ``seen`` (or a bounded time passes)."""
        words, lay = self.words, self.layout
        if not FUTEX_AVAILABLE:
            time.sleep(self.policy.sleep_max_s)
            return
        flag, bell = lay.control(self.me, field), lay.bell(self.me)
        words[flag] = 1  # announce, then look once more: a peer ringing after this store wakes us
        if words[bell] == seen:
            futex_wait(self.addr + 8 * bell, seen, self.policy.futex_timeout_s)
        words[flag] = 0

    def _guard(self, fn):  # type: ignore[no-untyped-def]
        """Run ``fn``; on a failure mark the link unusable and raise our ``ABORT`` flag for the peers."""
        try:
            return fn()
        except BaseException as exc:
            self._fail(exc)
            raise

    def _fail(self, exc: BaseException) -> None:
        if self.broken is None:
            self.broken = f"{type(exc).__name__}: {exc}"
        culprit = getattr(exc, "culprit", None)
        self.words[self.layout.control(self.me, ABORT)] = 1 + (self.me if culprit is None else culprit)

    # -- the pusher thread -----------------------------------------------------------------------------
    def _start_pusher(self) -> None:
        if self._pusher is None:
            self._pusher = threading.Thread(target=self._pusher_main, name=f"shardwise-shm-p2p-{self.axis}",
                                            daemon=True)
            self._pusher.start()
            me = weakref.ref(self)
            on_teardown(lambda: (link := me()) is not None and link.close())

    def close(self) -> None:
        """Stop the pusher (``sw.shutdown()``, the exit hook); queued sends are dropped. Collective-free."""
        self._stopping, self.broken = True, self.broken or "closed by shutdown"
        if self._pusher is not None and self._pusher.is_alive():
            self._work.set()
            self._ring(self.me, 0)  # a pusher asleep on its doorbell wakes now
            self._pusher.join(timeout=1.0)

    def _pusher_main(self) -> None:
        try:
            self._pusher_loop()
        except BaseException as exc:  # reported to the caller thread by its next wait
            self._error = exc
            self._fail(exc)
            self._ring(self.me, 1)

    def _pusher_loop(self) -> None:
        """Stream queued sends as their receivers free space; sleep on the doorbell in between."""
        p, words, bell = self.policy, self.words, self.layout.bell(self.me)
        while not self._stopping:
            if not any(self._sends.values()):
                self._work.clear()
                if not any(self._sends.values()):
                    self._work.wait()
                continue
            start = time.perf_counter()
            next_check = start + p.check_s
            while any(self._sends.values()) and not self._stopping:
                seen = words[bell]
                if self._push_queued():
                    start = time.perf_counter()
                    continue
                now = time.perf_counter()
                if now >= next_check:
                    late = [c for c, q in self._sends.items() if q]
                    self.waiter.check(late, f"send to rank {self.ranks[late[0]]}", now - start)
                    next_check = now + p.check_s
                if now - start >= p.yield_s:
                    self._sleep(SLEEP_PUSH, seen)
                else:
                    os.sched_yield()

    def _push_queued(self) -> bool:
        moved = False
        for queue in self._sends.values():
            while queue:
                op = queue[0]
                moved |= self._push(op, 1)
                if not op.done:
                    break
                queue.popleft()
                self._ring(self.me, 1)  # the caller thread may wait for this send
        return moved
