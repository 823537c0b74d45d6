"""``algorithm="shm"``: collectives through a shared-memory segment, for axis groups on one host.

Every member maps the group's segment (``shm_segment.py``); data moves by memory copies instead of loopback
TCP. A message is cut into *pieces* that go through ``K`` rotating slots (memory stays bounded whatever the
message size). Piece ``g`` (a sequence number every member counts alike) uses slot ``g % K``; each member
publishes its progress in its own counters and waits on its peers' (``shm_sync.py``):

* all-reduce (reduce-scatter + all-gather inside one slot): every member copies its piece into its region
  and publishes ``ARRIVE``; member ``j`` reduces sub-range ``j`` (``shard_sizes`` of the piece) of all
  regions, **in coordinate order** 0, 1, …, n-1, into the result region and publishes ``REDUCED``; every
  member copies the whole result out and publishes ``DONE``. Each element is reduced once, in one fixed
  order, so every member gets bit-identical values whatever the timing. Up to ``SMALL_BYTES`` every member
  instead reduces the whole piece itself (same order, same values): one wait instead of three. Larger
  messages are software-pipelined: a member deposits piece ``k+1`` before collecting piece ``k``, so the
  copy overlaps its peers' reductions. A member deposits only the sub-ranges *others* reduce and reads its
  own sub-range straight from its tensor (less memory traffic: copies are the cost here).
* reduce-scatter: member ``r`` copies, for each destination ``j``, its part of ``j``'s shard into
  sub-slot ``j`` of its region; member ``j`` reduces sub-slot ``j`` of all regions, in coordinate order,
  straight into its output (``ARRIVE`` then ``DONE``).
* all-gather: member ``r`` copies its chunk's piece into its region, every member copies everyone else's.
* broadcast: the source copies a piece in, the others copy it out.

Messages up to ``SMALL_BYTES`` go as one piece through raw ``memmove``s (no tensor ops: at a few bytes their
dispatch, not the copy, is the cost) with a single wait for the peers.

Before writing into a slot a member waits until every member has published ``DONE`` for the slot's
previous piece (``g - K``), so a fast rank runs at most ``K`` pieces ahead of the slowest.

All methods take flat, contiguous CPU tensors and are collective over the group (every member calls them
in the same order). A failure (a dead peer, a timeout, any exception) marks the group unusable and raises
the ``ABORT`` flag so that the peers stop waiting too.
"""

from __future__ import annotations

import ctypes
import math
from collections import OrderedDict
from typing import Callable, Sequence, TypeVar

import torch

from .ops import shard_offsets
from .shm_futex import FUTEX_AVAILABLE, futex_wake
from .shm_segment import ABORT, ARRIVE, DONE, FIELDS, REDUCED, SLEEP, Segment
from .shm_sync import Peer, ShmPeerError, Waiter, WaitPolicy

__all__ = ["ShmGroup", "DEFAULT_SLOTS", "DEFAULT_REGION_BYTES", "SMALL_BYTES", "check_shm_tensor"]

DEFAULT_SLOTS = 4
"""Slots in flight: lets ranks drift up to 4 pieces apart before the fastest waits."""
DEFAULT_REGION_BYTES = 1 << 20
"""Bytes per region (one rank's share of a slot): a piece of an all-reduce is at most this. Segment size
is ``slots · (n+1) · region`` (20 MiB for 4 ranks)."""
SMALL_BYTES = 64 << 10
"""All-reduces up to this size take the one-wait path where every member reduces the whole message: the
redundant reduction (n x 64 KiB read per rank, ~10-25 us) costs less than two more waits for every peer,
each of which needs all of them scheduled at once (measured at 64 KiB under load on 2 cores: 156 us median
with three waits)."""
THREADS_BYTES = 16 << 10
"""Above this many bytes a collective runs with one intra-op thread (see ``ShmGroup._guard``)."""
_SMALL_VIEWS = 64
"""Cached region views for the small path, least recently used dropped first (no per-call allocation)."""
_PER_THREAD_THREADS = "parallel backend: OpenMP" in torch.__config__.parallel_info()
"""OpenMP's thread count is a per-thread setting, so a collective may lower it for its own thread; the
native backend's is process-wide (and fixed once parallel work started): left alone there."""

T = TypeVar("T")


def check_shm_tensor(t: torch.Tensor) -> None:
    """``ValueError`` unless ``t`` lives in host memory (the segment is host memory)."""
    if t.device.type != "cpu":
        raise ValueError(f"algorithm 'shm' moves host memory, but the tensor is on {t.device}; use "
                         f"algorithm='native' (NCCL) for device tensors")


class ShmGroup:
    """One member's handle on an axis group's segment. Created by ``shm_rendezvous.shm_group_for``."""

    def __init__(self, seg: Segment, peers: Sequence[Peer], me: int, axis: str, timeout_s: float,
                 policy: WaitPolicy = WaitPolicy()) -> None:
        layout = seg.layout
        self.seg, self.layout, self.n, self.me, self.axis = seg, layout, layout.n, me, axis
        self.name = seg.name
        self.base = torch.frombuffer(seg.buf, dtype=torch.uint8)  # the whole segment, as bytes
        self.addr = self.base.data_ptr()
        index = [[layout.counter_index(c, f) for c in range(self.n)] for f in range(FIELDS)]
        self.waiter = Waiter(seg.words, index, peers, me, policy, timeout_s, axis, ABORT,
                             futex=(self.addr, index[SLEEP][me]))
        self._mine = [index[f][me] for f in range(FIELDS)]
        self._sleepers = [index[SLEEP][c] for c in range(self.n) if c != me]
        self.everyone = tuple(range(self.n))
        self.seq = 0
        """Pieces this group has started; the same on every member between collectives."""
        self.broken: str | None = None
        self._op = ""
        self._regions: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self._small: OrderedDict[tuple[int, torch.dtype, int], tuple[torch.Tensor, ...]] = OrderedDict()

    # -- plumbing ------------------------------------------------------------------------------------
    def _guard(self, collective: str, fn: Callable[[], T], nbytes: int) -> T:
        """Run ``fn`` (one collective); on any failure mark the group broken and raise our ``ABORT`` flag.

        Above ``THREADS_BYTES`` the calling thread's intra-op threads are set to 1 for the duration (a
        per-thread setting, restored after): copies and reductions here are memory-bound, and OpenMP
        workers that spin after each parallel region take the cores that peer ranks need — with 2 ranks of
        2 threads on 2 cores a 16 MiB all-reduce measured 16x slower."""
        if self.broken is not None:
            raise ShmPeerError(f"shm {collective} on axis {self.axis!r}: this group's shared memory is unusable "
                               f"after an earlier failure ({self.broken}); restart all ranks")
        self._op = collective
        threads = torch.get_num_threads() if nbytes > THREADS_BYTES and _PER_THREAD_THREADS else 1
        try:
            if threads > 1:
                torch.set_num_threads(1)
            return fn()
        except BaseException as exc:
            self.broken = f"{type(exc).__name__}: {exc}"
            culprit = getattr(exc, "culprit", None)
            self.seg.words[self._mine[ABORT]] = 1 + (self.me if culprit is None else culprit)
            raise
        finally:
            if threads > 1:
                torch.set_num_threads(threads)

    def _publish(self, field: int, value: int) -> None:
        """Store our counter, then wake the peers asleep on it (a look at their sleeper words: no system
        call unless someone sleeps)."""
        words, k = self.seg.words, self._mine[field]
        words[k] = value
        for s in self._sleepers:
            if words[s] == k + 1:
                if FUTEX_AVAILABLE:
                    futex_wake(self.addr + 8 * k)
                break

    def _begin(self) -> tuple[int, int]:
        """Claim the next piece: (its sequence number, its slot), once the slot's previous use is done."""
        g, k = self.seq, self.layout.slots
        self.seq = g + 1
        if g >= k:
            self.waiter.wait(DONE, g - k + 1, self.everyone, self._op)
        return g, g % k

    def _region(self, slot: int, region: int, dtype: torch.dtype) -> torch.Tensor:
        """``region`` of ``slot`` as a 1-D ``dtype`` tensor over the whole region (a view of the segment)."""
        key = (slot, region, dtype)
        view = self._regions.get(key)
        if view is None:
            off = self.layout.region_offset(slot, region)
            view = self._regions[key] = self.base[off:off + self.layout.region_bytes].view(dtype)
        return view

    def _piece_elems(self, piece_bytes: int, itemsize: int, parts: int = 1) -> int:
        return max(1, min(piece_bytes, self.layout.region_bytes) // itemsize // parts)

    def _small_fits(self, flat: torch.Tensor) -> bool:
        """Whether the whole message goes as one piece through raw copies (``SMALL_BYTES`` and the region)."""
        nbytes = flat.numel() * flat.element_size()
        return nbytes <= min(SMALL_BYTES, self.layout.region_bytes)

    def _memmove_in(self, slot: int, flat: torch.Tensor, a: int, b: int) -> None:
        """Elements ``a:b`` of ``flat`` to the start of our region of ``slot``."""
        size = flat.element_size()
        if b > a:
            ctypes.memmove(self.addr + self.layout.region_offset(slot, self.me), flat.data_ptr() + a * size,
                           (b - a) * size)

    def _memmove_out(self, slot: int, j: int, flat: torch.Tensor, a: int, b: int) -> None:
        """The start of member ``j``'s region of ``slot`` to elements ``a:b`` of ``flat``."""
        size = flat.element_size()
        if b > a:
            ctypes.memmove(flat.data_ptr() + a * size, self.addr + self.layout.region_offset(slot, j),
                           (b - a) * size)

    # -- all-reduce ----------------------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, op: str, piece_bytes: int) -> None:
        """Reduce ``flat`` over the group in place (``avg`` divided here)."""
        if self.n == 1 or flat.numel() == 0:
            return
        piece = self._piece_elems(piece_bytes, flat.element_size())
        if flat.numel() * flat.element_size() <= SMALL_BYTES and flat.numel() <= piece:
            return self._guard("all_reduce", lambda: self._all_reduce_small(flat, op),
                               flat.numel() * flat.element_size())

        self._guard("all_reduce", lambda: self._all_reduce_pieces(flat, op, piece),
                    flat.numel() * flat.element_size())

    def _small_views(self, slot: int, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, ...]:
        key = (slot, dtype, numel)
        views = self._small.pop(key, None)
        if views is None:
            views = tuple(self._region(slot, j, dtype)[:numel] for j in range(self.n))
        self._small[key] = views
        if len(self._small) > _SMALL_VIEWS:
            self._small.popitem(last=False)
        return views

    def _all_reduce_small(self, flat: torch.Tensor, op: str) -> None:
        g, slot = self._begin()
        views = self._small_views(slot, flat.dtype, flat.numel())
        self._memmove_in(slot, flat, 0, flat.numel())
        self._publish(ARRIVE, g + 1)
        self.waiter.wait(ARRIVE, g + 1, self.everyone, self._op)
        reduce_ordered(flat, views, op)
        self._publish(DONE, g + 1)

    def _all_reduce_pieces(self, flat: torch.Tensor, op: str, piece: int) -> None:
        """Software-pipelined: each piece is deposited before the previous one is collected, so a rank
        copies its next piece in while waiting for its peers to finish reducing the current one."""
        prev = None
        for a in range(0, flat.numel(), piece):
            cur = self._deposit(flat[a:a + piece])
            if prev is not None:
                self._collect(*prev)
            self._reduce(*cur, op)
            prev = cur
        if prev is not None:
            self._collect(*prev)

    def _deposit(self, x: torch.Tensor) -> tuple[int, int, torch.Tensor]:
        """Claim a piece for ``x`` and copy in what the other reducers need (our own sub-range stays in
        ``x``: less traffic); publish ``ARRIVE``."""
        g, slot = self._begin()
        bounds = shard_offsets(x.numel(), self.n)
        lo, hi = bounds[self.me], bounds[self.me + 1]
        mine = self._region(slot, self.me, x.dtype)
        mine[:lo].copy_(x[:lo])
        mine[hi:x.numel()].copy_(x[hi:])
        self._publish(ARRIVE, g + 1)
        return g, slot, x

    def _reduce(self, g: int, slot: int, x: torch.Tensor, op: str) -> None:
        """Reduce our sub-range of the piece, in coordinate order, into the result region; ``REDUCED``."""
        bounds = shard_offsets(x.numel(), self.n)
        lo, hi, me = bounds[self.me], bounds[self.me + 1], self.me
        self.waiter.wait(ARRIVE, g + 1, self.everyone, self._op)
        if hi > lo:
            parts = [x[lo:hi] if j == me else self._region(slot, j, x.dtype)[lo:hi] for j in range(self.n)]
            reduce_ordered(self._region(slot, self.n, x.dtype)[lo:hi], parts, op)
        self._publish(REDUCED, g + 1)

    def _collect(self, g: int, slot: int, x: torch.Tensor) -> None:
        """Copy the whole reduced piece out once every reducer is done; ``DONE``."""
        self.waiter.wait(REDUCED, g + 1, self.everyone, self._op)
        x.copy_(self._region(slot, self.n, x.dtype)[:x.numel()])
        self._publish(DONE, g + 1)

    # -- reduce-scatter ------------------------------------------------------------------------------
    def reduce_scatter(self, flat: torch.Tensor, op: str, offsets: Sequence[int], piece_bytes: int) -> torch.Tensor:
        """Return this member's chunk ``offsets[me]:offsets[me+1]`` of the reduction of ``flat`` (not modified)."""
        i = self.me
        if self.n == 1:
            out = flat[offsets[0]:offsets[1]].clone()
            return out
        lens = [b - a for a, b in zip(offsets, offsets[1:])]
        out = torch.empty(lens[i], dtype=flat.dtype)
        if self._small_fits(flat):
            return self._guard("reduce_scatter", lambda: self._reduce_scatter_small(flat, out, op, offsets),
                               flat.numel() * flat.element_size())
        sub = self._piece_elems(piece_bytes, flat.element_size(), self.n)  # elements per destination

        def run() -> None:
            for k in range(math.ceil(max(lens) / sub)):
                self._reduce_scatter_piece(flat, out, op, offsets, lens, k * sub, sub)
        self._guard("reduce_scatter", run, flat.numel() * flat.element_size())
        return out

    def _reduce_scatter_small(self, flat: torch.Tensor, out: torch.Tensor, op: str,
                              offsets: Sequence[int]) -> torch.Tensor:
        """One wait: every member deposits its whole input; member ``j`` reduces chunk ``j`` of all regions."""
        g, slot = self._begin()
        self._memmove_in(slot, flat, 0, flat.numel())
        self._publish(ARRIVE, g + 1)
        self.waiter.wait(ARRIVE, g + 1, self.everyone, self._op)
        lo, hi = offsets[self.me], offsets[self.me + 1]
        if hi > lo:
            views = self._small_views(slot, flat.dtype, flat.numel())
            parts = [flat[lo:hi] if j == self.me else views[j][lo:hi] for j in range(self.n)]
            reduce_ordered(out, parts, op)
        self._publish(DONE, g + 1)
        return out

    def _reduce_scatter_piece(self, flat: torch.Tensor, out: torch.Tensor, op: str, offsets: Sequence[int],
                              lens: list[int], a: int, sub: int) -> None:
        g, slot = self._begin()
        me, mine = self.me, self._region(slot, self.me, flat.dtype)
        for j in range(self.n):  # my part of j's chunk -> sub-slot j of my region (my own chunk stays in flat)
            m = min(a + sub, lens[j]) - a
            if m > 0 and j != me:
                mine[j * sub:j * sub + m].copy_(flat[offsets[j] + a:offsets[j] + a + m])
        self._publish(ARRIVE, g + 1)
        self.waiter.wait(ARRIVE, g + 1, self.everyone, self._op)
        m, lo = min(a + sub, lens[me]) - a, me * sub
        if m > 0:
            own = flat[offsets[me] + a:offsets[me] + a + m]
            parts = [own if j == me else self._region(slot, j, flat.dtype)[lo:lo + m] for j in range(self.n)]
            reduce_ordered(out[a:a + m], parts, op)
        self._publish(DONE, g + 1)

    # -- all-gather ----------------------------------------------------------------------------------
    def all_gather(self, flat: torch.Tensor, offsets: Sequence[int], piece_bytes: int) -> None:
        """``flat`` holds this member's chunk at ``offsets[me]:offsets[me+1]``; fill in every other chunk."""
        if self.n == 1:
            return
        lens = [b - a for a, b in zip(offsets, offsets[1:])]
        if self._small_fits(flat):
            return self._guard("all_gather", lambda: self._all_gather_small(flat, offsets),
                               flat.numel() * flat.element_size())
        per = self._piece_elems(piece_bytes, flat.element_size())

        def run() -> None:
            for k in range(math.ceil(max(lens) / per)):
                self._all_gather_piece(flat, offsets, lens, k * per, per)
        self._guard("all_gather", run, flat.numel() * flat.element_size())

    def _all_gather_small(self, flat: torch.Tensor, offsets: Sequence[int]) -> None:
        """One piece, raw copies (no tensor ops: at a few bytes their dispatch is the cost)."""
        g, slot = self._begin()
        me = self.me
        self._memmove_in(slot, flat, offsets[me], offsets[me + 1])
        self._publish(ARRIVE, g + 1)
        self.waiter.wait(ARRIVE, g + 1, self.everyone, self._op)
        for j in range(self.n):
            if j != me:
                self._memmove_out(slot, j, flat, offsets[j], offsets[j + 1])
        self._publish(DONE, g + 1)

    def _all_gather_piece(self, flat: torch.Tensor, offsets: Sequence[int], lens: list[int], a: int,
                          per: int) -> None:
        g, slot = self._begin()
        m = min(a + per, lens[self.me]) - a
        if m > 0:
            start = offsets[self.me] + a
            self._region(slot, self.me, flat.dtype)[:m].copy_(flat[start:start + m])
        self._publish(ARRIVE, g + 1)
        self.waiter.wait(ARRIVE, g + 1, self.everyone, self._op)
        for j in range(self.n):
            m = min(a + per, lens[j]) - a
            if j != self.me and m > 0:
                flat[offsets[j] + a:offsets[j] + a + m].copy_(self._region(slot, j, flat.dtype)[:m])
        self._publish(DONE, g + 1)

    # -- broadcast -----------------------------------------------------------------------------------
    def broadcast(self, flat: torch.Tensor, root: int, piece_bytes: int) -> None:
        """Copy the member ``root``'s ``flat`` into every member's ``flat``."""
        if self.n == 1 or flat.numel() == 0:
            return
        if self._small_fits(flat):
            return self._guard("broadcast", lambda: self._broadcast_small(flat, root),
                               flat.numel() * flat.element_size())
        per = self._piece_elems(piece_bytes, flat.element_size())

        def run() -> None:
            for a in range(0, flat.numel(), per):
                self._broadcast_piece(flat[a:a + per], root)
        self._guard("broadcast", run, flat.numel() * flat.element_size())

    def _broadcast_small(self, flat: torch.Tensor, root: int) -> None:
        g, slot = self._begin()
        if self.me == root:
            self._memmove_in(slot, flat, 0, flat.numel())
            self._publish(ARRIVE, g + 1)
        else:
            self.waiter.wait(ARRIVE, g + 1, (root,), self._op)
            self._memmove_out(slot, root, flat, 0, flat.numel())
        self._publish(DONE, g + 1)

    def _broadcast_piece(self, x: torch.Tensor, root: int) -> None:
        g, slot = self._begin()
        region = self._region(slot, root, x.dtype)[:x.numel()]
        if self.me == root:
            region.copy_(x)
            self._publish(ARRIVE, g + 1)
        else:
            self.waiter.wait(ARRIVE, g + 1, (root,), self._op)
            x.copy_(region)
        self._publish(DONE, g + 1)


def reduce_ordered(out: torch.Tensor, parts: Sequence[torch.Tensor], op: str) -> None:
    """``out = parts[0] (op) parts[1] (op) ...`` left to right (``avg``: the sum divided by ``len(parts)``).
    The fixed order is what makes every rank's result bit-identical. ``out`` may alias none of ``parts``
    except ``parts[0]``."""
    first, rest = parts[0], parts[1:]
    if op in ("sum", "avg"):
        torch.add(first, rest[0], out=out) if rest else out.copy_(first)
        for p in rest[1:]:
            out.add_(p)
        if op == "avg":
            out.div_(len(parts))
    elif op in ("max", "min"):
        fn = torch.maximum if op == "max" else torch.minimum
        fn(first, rest[0], out=out) if rest else out.copy_(first)
        for p in rest[1:]:
            fn(out, p, out=out)
    else:  # pragma: no cover - validated by the caller
        raise AssertionError(op)
