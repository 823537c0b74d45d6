"""Lower a compute-only schedule to one with explicit send/receive actions, for an executor to interpret.

Rules (stage ``s`` on rank ``s % p``; nothing is inserted between two stages on the same rank):

* after ``F(s, i)``: ``SEND_F(s, i)`` (output activation to stage s+1);
* after ``B(s, i)``: ``SEND_B(s, i)`` (input gradient to stage s-1);
* before ``F(s, i)``: ``RECV_F(s, i)``; before ``B(s, i)``: ``RECV_B(s, i)``.

Receives are posted early, by two rules (the earlier position wins):

* ``recv_ahead`` (default 1): at least that many of this rank's compute actions before the one that consumes
  the message;
* ``recv_before_send`` (default on): before the compute action this rank is running when the sender sends the
  message, in the simulated run of the schedule at unit costs (``simulate``: F = B = W = 1, a whole backward
  2) — or at the start of the list when the message is sent before this rank starts.

Why: gloo moves a message only once the receiver has posted its receive (a rendezvous). Posted after the
send, the message waits at the sender, and the transfer then runs when the receiver posts — usually while the
sender computes, so the transfer's threads compete with compute for the cores and the receiver stalls for
milliseconds (measured: ``benchmarks/RESULTS.md``). Posted before the send, the transfer happens as soon as
the sender sends and the receiver finds its input there. Schedules whose warm-up sends far ahead (ZB-H2,
interleaved) need the second rule; the first gives 1F1B its steady-state pairing (the next forward's receive
goes out with the backward's send). The cost is one receive buffer per message posted and not yet consumed —
at most the messages the schedule has in flight anyway in the unit-cost run, plus ``recv_ahead`` per
boundary. ``recv_ahead=0, recv_before_send=False`` places every receive just before its consumer.

Transports that match messages by order rather than by tag (NCCL) need every receiver to post its
receives from one sender in the order that sender sends them. A receive is therefore posted early when
needed: before posting a message, the receiver posts every earlier message from the same sender that
it has not posted yet. Posting an asynchronous receive early only reserves its buffer.
"""

from __future__ import annotations

from bisect import bisect_left

from .actions import Action, Schedule
from .simulate import simulate

__all__ = ["lower_communication", "message_order", "receive_placement", "TRANSPORTS", "check_transport"]

TRANSPORTS = ("native", "shm", "auto")
"""How pipeline messages travel: ``native`` (the backend's isend/irecv: gloo or NCCL), ``shm`` (a shared-memory
channel per ordered pair of ranks, ``comm/shm_p2p.py``: CPU tensors, every rank of the axis on one host),
``auto`` (shm where it can run, else native)."""


def check_transport(transport: object, device_type: str) -> None:
    """``ValueError`` unless ``transport`` is one of ``TRANSPORTS`` and can run on ``device_type``. Pure."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if transport == "shm" and device_type != "cpu":
        raise ValueError(f"transport='shm' moves host memory, but the mesh is on {device_type}; use "
                         f"transport='native' (or 'auto', which picks native there)")


def _sends_after(a: Action, schedule: Schedule) -> list[tuple[Action, int, Action]]:
    """(send action, destination rank, matching receive action) that ``a`` produces."""
    s, i, last = a.stage, a.microbatch, schedule.num_stages - 1
    out = []
    if a.kind == "F" and s < last:
        out.append((Action(s, "SEND_F", i), schedule.rank_of(s + 1), Action(s + 1, "RECV_F", i)))
    if a.kind == "B" and s > 0:
        out.append((Action(s, "SEND_B", i), schedule.rank_of(s - 1), Action(s - 1, "RECV_B", i)))
    me = schedule.rank_of(s)
    return [x for x in out if x[1] != me]


def _recv_needed(a: Action, schedule: Schedule) -> Action | None:
    """The receive that must precede compute action ``a`` (``None`` if its input is local)."""
    s, i, last = a.stage, a.microbatch, schedule.num_stages - 1
    if a.kind == "F" and s > 0 and schedule.rank_of(s - 1) != schedule.rank_of(s):
        return Action(s, "RECV_F", i)
    if a.kind == "B" and s < last and schedule.rank_of(s + 1) != schedule.rank_of(s):
        return Action(s, "RECV_B", i)
    return None


def _source_rank(recv: Action, schedule: Schedule) -> int:
    return schedule.rank_of(recv.stage - 1 if recv.kind == "RECV_F" else recv.stage + 1)


def lower_communication(schedule: Schedule, *, recv_ahead: int = 1, recv_before_send: bool = True) -> Schedule:
    """The same schedule with ``SEND_*``/``RECV_*`` actions inserted (see module doc); pure.

    ``recv_ahead``: a receive is posted at least this many of this rank's compute actions before the compute
    that consumes it (0: immediately before it). ``recv_before_send``: also post it before the compute action this
    rank runs when the message is sent, in the unit-cost simulation (raises ``ScheduleDeadlock`` for a
    schedule that cannot finish)."""
    if isinstance(recv_ahead, bool) or not isinstance(recv_ahead, int) or recv_ahead < 0:
        raise ValueError(f"recv_ahead must be an integer >= 0 (compute actions a receive is posted ahead of its "
                         f"consumer), got {recv_ahead!r}")
    compute = [[a for a in acts if a.is_compute] for acts in schedule.ranks]
    # queue[(src, dst)]: the receive actions dst must post, in src's send order
    queue: dict[tuple[int, int], list[Action]] = {}
    for src, acts in enumerate(compute):
        for a in acts:
            for _, dst, recv in _sends_after(a, schedule):
                queue.setdefault((src, dst), []).append(recv)
    # unit-cost run: when each action starts, and when each message is sent (its producer ends)
    timeline = simulate(schedule).timeline if recv_before_send else ()
    start = {e.action: e.start for e in timeline}
    sent_at = {recv: e.end for e in timeline for _, _, recv in _sends_after(e.action, schedule)}
    ranks = []
    for r, acts in enumerate(compute):
        posts = _post_positions(acts, schedule, recv_ahead, [start.get(a, 0.0) for a in acts], sent_at)
        posted: set[Action] = set()
        cursor: dict[int, int] = {}  # src -> how many of queue[(src, r)] are posted
        out: list[Action] = []
        for k, a in enumerate(acts):
            for need in posts.get(k, []):
                out += _post_through(need, r, schedule, queue, cursor, posted)
            out.append(a)
            out += [send for send, _, _ in _sends_after(a, schedule)]
        ranks.append(tuple(out))
    return Schedule(name=schedule.name, p=schedule.p, m=schedule.m, chunks=schedule.chunks,
                    split_backward=schedule.split_backward, ranks=tuple(ranks), forward_only=schedule.forward_only)


def receive_placement(device_type: str, recv_ahead: int | None = None,
                      recv_before_send: bool | None = None) -> tuple[int, bool]:
    """``(recv_ahead, recv_before_send)`` for a pipeline on ``device_type``; ``None`` takes the default.

    Early receives help transports whose progress runs on the host (gloo: 1 and True). On CUDA (NCCL) a
    communicator runs its operations in order on one stream, where an early receive would hold up the sends
    queued after it, so the default there is the placement just before the consumer (0 and False)."""
    cuda = device_type == "cuda"
    return ((0 if cuda else 1) if recv_ahead is None else recv_ahead,
            (not cuda) if recv_before_send is None else bool(recv_before_send))


def _post_positions(acts: list[Action], schedule: Schedule, recv_ahead: int, starts: list[float],
                    sent_at: dict[Action, float]) -> dict[int, list[Action]]:
    """Compute-action index on this rank -> the receives to post just before it (in consumer order).
    ``starts``: each action's simulated start; ``sent_at``: receive -> simulated send time (empty: rule off)."""
    posts: dict[int, list[Action]] = {}
    for k, a in enumerate(acts):
        need = _recv_needed(a, schedule)
        if need is None:
            continue
        at = max(0, k - recv_ahead)
        if need in sent_at:  # the action running when it is sent: the last one that started before
            started = bisect_left(starts, sent_at[need], 0, k)  # a rank's starts increase along its list
            at = min(at, max(started - 1, 0))
        posts.setdefault(at, []).append(need)
    return posts


def _post_through(need: Action, r: int, schedule: Schedule, queue: dict[tuple[int, int], list[Action]],
                  cursor: dict[int, int], posted: set[Action]) -> list[Action]:
    """The receives rank ``r`` must post now so that ``need`` is posted: every not yet posted message from the
    same sender up to ``need``, in that sender's send order (updates ``cursor`` and ``posted``)."""
    if need in posted:
        return []
    src = _source_rank(need, schedule)
    q = queue[(src, r)]
    stop = q.index(need)  # ValueError here would mean the sender never sends it
    new = q[cursor.get(src, 0):stop + 1]
    cursor[src] = stop + 1
    posted.update(new)
    return new


def message_order(schedule: Schedule) -> dict[tuple[int, int], tuple[list[str], list[str]]]:
    """Per (src rank, dst rank): the messages src sends and dst receives, in list order, as ``"F3:1"``
    (kind, micro-batch, receiving stage). Equal lists mean order-matching transports pair them correctly."""
    pairs: dict[tuple[int, int], tuple[list[str], list[str]]] = {}
    for r, acts in enumerate(schedule.ranks):
        for a in acts:
            if a.kind in ("SEND_F", "SEND_B"):
                to = a.stage + 1 if a.kind == "SEND_F" else a.stage - 1
                pairs.setdefault((r, schedule.rank_of(to)), ([], []))[0].append(f"{a.kind[-1]}{a.microbatch}:{to}")
            elif a.kind in ("RECV_F", "RECV_B"):
                src = _source_rank(a, schedule)
                pairs.setdefault((src, r), ([], []))[1].append(f"{a.kind[-1]}{a.microbatch}:{a.stage}")
    return pairs
