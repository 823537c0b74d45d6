"""The flush simulator the planner runs hundreds of times per search: the event rules of
``shardwise.parallel.pipeline.simulate`` (an action starts when its rank is free and its dependencies have ended,
plus the boundary transfer when a dependency ran on another rank), compiled once per schedule.

Which action runs next never depends on the costs, so the completion order and every action's dependency
positions are fixed by the schedule alone; a simulation is then one pass over that order. Pure.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["fast_simulate"]


def fast_simulate(schedule: Any, F: Sequence[float], B: Sequence[float], W: Sequence[float],
                  comm: Sequence[float]) -> tuple[float, tuple[float, ...], tuple[int, ...]]:
    """``(makespan, busy per rank, peak in flight per rank)`` of ``schedule`` — the same event rules as
    ``parallel.pipeline.simulate`` (tested equal), without ``Action`` objects or re-validation: the search
    simulates hundreds of long flushes.

    Which action runs next never depends on the costs (an action waits for its rank's previous one and for its
    dependencies, whatever they cost), so the order and the dependency indices are compiled once per schedule
    (``_compiled``) and a simulation is one pass over them: ``end = max(rank free, deps' ends + transfer) + cost``.
    """
    order, p, peaks = _compiled(schedule)
    n = len(F)
    # cost of each (kind, stage): kind 0 = F, 1 = B (with W unless backward is split), 2 = W
    split = schedule.split_backward
    costs = list(F) + [B[s] + (0.0 if split else W[s]) for s in range(n)] + list(W)
    links = [*comm[:n - 1], 0.0]  # the last entry: a dependency on the same rank (no transfer)
    end = [0.0] * len(order)
    free = [0.0] * p
    busy = [0.0] * p
    for i, (r, c, deps) in enumerate(order):
        ready = free[r]
        for d, k in deps:
            t = end[d] + links[k]
            if t > ready:
                ready = t
        cost = costs[c]
        end[i] = free[r] = ready + cost
        busy[r] += cost
    return max(free, default=0.0), tuple(busy), peaks


_COMPILED: dict[int, tuple[Any, tuple]] = {}


def _compiled(schedule: Any) -> tuple[list[tuple[int, int, tuple[tuple[int, int], ...]]], int, tuple[int, ...]]:
    """``(order, p, peaks)``: every compute action as ``(rank, cost index, ((dep position, link index), ...))``
    in an order where dependencies come first and each rank's actions keep their order — the order the event
    rules of ``parallel.pipeline.simulate`` complete them in — and each rank's peak activation sets in flight.
    Memoised per schedule object (the schedules themselves are memoised by ``_schedule``)."""
    hit = _COMPILED.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    out = (_order(schedule), schedule.p, _peaks(schedule))
    if len(_COMPILED) > 256:
        _COMPILED.clear()
    _COMPILED[id(schedule)] = (schedule, out)
    return out


def _lists(schedule: Any) -> list[list[tuple[int, int, int]]]:
    """Each rank's compute actions as ``(stage, kind, micro-batch)``, kind 0 = F, 1 = B, 2 = W."""
    kind_index = {"F": 0, "B": 1, "W": 2}
    return [[(a.stage, kind_index[a.kind], a.microbatch) for a in acts if a.is_compute] for acts in schedule.ranks]


def _order(schedule: Any) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
    """The compiled order (see ``_compiled``). Any order that puts every action after its dependencies and its
    rank's earlier actions gives the same end times, so ranks are run from a work list: a rank runs its next
    actions until one waits for an action not done yet, and is woken when that action is done."""
    n = schedule.num_stages
    rank_of = [schedule.rank_of(st) for st in range(n)]
    lists = _lists(schedule)
    width = 1 + max((i for acts in lists for _, _, i in acts), default=0)
    # an action's slot: (kind · n + stage) · width + micro-batch; at_slot[slot] = its position in ``order``
    at_slot = [-1] * (3 * n * width)
    waiting: dict[int, list[int]] = {}
    order: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    pos = [0] * schedule.p
    ready = list(range(schedule.p - 1, -1, -1))
    while ready:
        r = ready.pop()
        acts, k = lists[r], pos[r]
        while k < len(acts):
            st, kind, i = acts[k]
            links = _links(st, kind, i, r, n, width, rank_of, at_slot)
            if isinstance(links, int):  # waits for the action in that slot
                waiting.setdefault(links, []).append(r)
                break
            slot = (kind * n + st) * width + i
            at_slot[slot] = len(order)
            order.append((r, kind * n + st, links))
            if slot in waiting:
                ready.extend(waiting.pop(slot))
            k += 1
        pos[r] = k
    if any(pos[r] < len(lists[r]) for r in range(schedule.p)):
        raise ValueError(f"schedule {schedule.name!r} deadlocks; simulate it with shardwise schedule for details")
    return order


def _links(st: int, kind: int, i: int, r: int, n: int, width: int, rank_of: list[int],
           at_slot: list[int]) -> tuple[tuple[int, int], ...] | int:
    """The dependencies of action ``(st, kind, i)`` on rank ``r`` as ``((position, link index), ...)``, or the
    slot of the first one not done yet. A dependency on the action's own stage runs on this rank (no transfer);
    one on the neighbouring stage crosses their boundary unless that stage is on this rank too."""
    no_link = n - 1  # ``links[n - 1]`` is the 0.0 after the ``n - 1`` boundary transfers
    if kind == 0:  # F waits for the previous stage's F
        if st == 0:
            return ()
        slot = (st - 1) * width + i
        if at_slot[slot] < 0:
            return slot
        return ((at_slot[slot], st - 1 if rank_of[st - 1] != r else no_link),)
    slot = (st * width + i) if kind == 1 else ((n + st) * width + i)  # B: its own F; W: its own B
    if at_slot[slot] < 0:
        return slot
    own = (at_slot[slot], no_link)
    if kind == 2 or st == n - 1:
        return (own,)
    slot = (n + st + 1) * width + i  # B also waits for the next stage's B
    if at_slot[slot] < 0:
        return slot
    return (own, (at_slot[slot], st if rank_of[st + 1] != r else no_link))


def _peaks(schedule: Any) -> tuple[int, ...]:
    """Each rank's peak activation sets in flight: an F adds one, the action that frees it (W when backward is
    split, else B) drops one."""
    freeing = 2 if schedule.split_backward else 1
    peaks = []
    for acts in _lists(schedule):
        held = peak = 0
        for _, kind, _ in acts:
            if kind == 0:
                held += 1
                peak = max(peak, held)
            elif kind == freeing:
                held -= 1
        peaks.append(peak)
    return tuple(peaks)
