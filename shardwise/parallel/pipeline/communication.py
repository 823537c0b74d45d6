"""Lower a compute-only schedule to one with explicit send/receive actions, for an executor to interpret.

Rules (stage ``s`` on rank ``s % p``; nothing is inserted between two stages on the same rank):

* after ``F(s, i)``: ``SEND_F(s, i)`` (output activation to stage s+1);
* after ``B(s, i)``: ``SEND_B(s, i)`` (input gradient to stage s-1);
* before ``F(s, i)``: ``RECV_F(s, i)``; before ``B(s, i)``: ``RECV_B(s, i)``.

Receives are posted ahead of their consumer (``recv_ahead`` compute actions earlier, default 1): the
receive for ``F(s, i)`` is posted before the compute action that precedes ``F(s, i)`` on this rank, right
after that rank's previous sends. The transport can then deliver the message while both ends compute;
posted only just before its consumer, a message the sender finished long ago is delivered only then, and on
transports whose progress needs the receiver's host thread (gloo) the consumer waits for the whole transfer.
The cost is one extra receive buffer per incoming boundary. ``recv_ahead=0`` gives the late placement.

Transports that match messages by order rather than by tag (NCCL) need every receiver to post its
receives from one sender in the order that sender sends them. A receive is therefore posted early when
needed: before posting a message, the receiver posts every earlier message from the same sender that
it has not posted yet. Posting an asynchronous receive early only reserves its buffer.
"""

from __future__ import annotations

from .actions import Action, Schedule

__all__ = ["lower_communication", "message_order"]


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


def lower_communication(schedule: Schedule, *, recv_ahead: int = 1) -> Schedule:
    """The same schedule with ``SEND_*``/``RECV_*`` actions inserted (see module doc); pure.

    ``recv_ahead``: how many of this rank's compute actions earlier a receive is posted than the compute that
    consumes it (0: immediately before it)."""
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
    ranks = []
    for r, acts in enumerate(compute):
        posted: set[Action] = set()
        cursor: dict[int, int] = {}  # src -> how many of queue[(src, r)] are posted
        out: list[Action] = []
        for k, a in enumerate(acts):
            for consumer in acts[k:k + recv_ahead + 1]:
                out += _post_through(_recv_needed(consumer, schedule), r, schedule, queue, cursor, posted)
            out.append(a)
            out += [send for send, _, _ in _sends_after(a, schedule)]
        ranks.append(tuple(out))
    return Schedule(name=schedule.name, p=schedule.p, m=schedule.m, chunks=schedule.chunks,
                    split_backward=schedule.split_backward, ranks=tuple(ranks))


def _post_through(need: Action | None, r: int, schedule: Schedule, queue: dict[tuple[int, int], list[Action]],
                  cursor: dict[int, int], posted: set[Action]) -> list[Action]:
    """The receives rank ``r`` must post now so that ``need`` is posted: every not yet posted message from the
    same sender up to ``need``, in that sender's send order (updates ``cursor`` and ``posted``)."""
    if need is None or need in posted:
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
