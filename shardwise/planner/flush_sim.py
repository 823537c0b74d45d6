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
    end = [0.0] * (len(order) + 1)  # end[-1] stays 0.0: what a missing dependency points at (never later)
    free = [0.0] * p
    busy = [0.0] * p
    for i, (r, c, a, la, b, lb) in enumerate(order):
        ready = free[r]
        t = end[a] + links[la]
        if t > ready:
            ready = t
        t = end[b] + links[lb]
        if t > ready:
            ready = t
        cost = costs[c]
        end[i] = free[r] = ready + cost
        busy[r] += cost
    return max(free, default=0.0), tuple(busy), peaks


Compiled = list[tuple[int, int, int, int, int, int]]
"""Every compute action as ``(rank, cost index, dep position, link index, dep position, link index)``: two
dependencies each, a missing one pointing at the position after the last action (whose end is 0.0) over the
same-rank link (0.0), so a simulation step needs no branch on how many it has."""

_COMPILED: dict[int, tuple[Any, tuple]] = {}


def _compiled(schedule: Any) -> tuple[Compiled, int, tuple[int, ...]]:
    """``(order, p, peaks)``: every compute action (``Compiled``) in an order where dependencies come first
    and each rank's actions keep their order — the order the event rules of ``parallel.pipeline.simulate``
    complete them in — and each rank's peak activation sets in flight. Memoised per schedule object (the
    schedules themselves are memoised by ``_schedule``)."""
    hit = _COMPILED.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    lists = _lists(schedule)
    out = (_order(schedule, lists), schedule.p, _peaks(schedule, lists))
    if len(_COMPILED) > 256:
        _COMPILED.clear()
    _COMPILED[id(schedule)] = (schedule, out)
    return out


def _lists(schedule: Any) -> list[list[tuple[int, int, int]]]:
    """Each rank's compute actions as ``(stage, kind, micro-batch)``, kind 0 = F, 1 = B, 2 = W."""
    kind_index = {"F": 0, "B": 1, "W": 2}
    return [[(a.stage, kind_index[a.kind], a.microbatch) for a in acts if a.is_compute] for acts in schedule.ranks]


def _order(schedule: Any, lists: list[list[tuple[int, int, int]]]) -> Compiled:
    """The compiled order (see ``_compiled``). Any order that puts every action after its dependencies and its
    rank's earlier actions gives the same end times, so ranks are run from a work list: a rank runs its next
    actions until one waits for an action not done yet, and is woken when that action is done."""
    p = schedule.p
    deps = _dependencies(schedule, lists)
    total = sum(len(acts) for acts in lists)
    at_slot = [-1] * (deps[1] + 1)  # at_slot[slot]: the action's position in ``order``, -1 until it runs
    at_slot[-1] = total  # the "no dependency" slot
    waiting: dict[int, list[int]] = {}
    order: Compiled = []
    pos = [0] * p
    ready = list(range(p - 1, -1, -1))
    while ready:
        r = ready.pop()
        acts, k = deps[0][r], pos[r]
        while k < len(acts):
            slot, c, da, la, db, lb = acts[k]
            pa, pb = at_slot[da], at_slot[db]
            if pa < 0 or pb < 0:  # waits for the action in that slot
                waiting.setdefault(da if pa < 0 else db, []).append(r)
                break
            at_slot[slot] = len(order)
            order.append((r, c, pa, la, pb, lb))
            woken = waiting.pop(slot, None)
            if woken:
                ready.extend(woken)
            k += 1
        pos[r] = k
    if any(pos[r] < len(lists[r]) for r in range(p)):
        raise ValueError(f"schedule {schedule.name!r} deadlocks; simulate it with shardwise schedule for details")
    return order


def _dependencies(schedule: Any, lists: list[list[tuple[int, int, int]]]) -> tuple[list[list[tuple]], int]:
    """Per rank, each action as ``(slot, cost index, dep slot, link index, dep slot, link index)``, and the
    "no dependency" slot. An action's slot is ``(kind · n + stage) · width + micro-batch``. F waits for the
    previous stage's F; B for its own F and the next stage's B; W for its own B. A dependency on the action's
    own stage runs on this rank (no transfer); one on the neighbouring stage crosses their boundary (link
    index = the boundary) unless that stage is on this rank too (link ``n - 1``, the 0.0 after the transfers)."""
    n, p = schedule.num_stages, schedule.p
    width = 1 + max((i for acts in lists for _, _, i in acts), default=0)
    none, same = 3 * n * width, n - 1
    out = []
    for r, acts in enumerate(lists):
        rows = []
        for st, kind, i in acts:
            slot = (kind * n + st) * width + i
            if kind == 0:
                row = (none, same) if st == 0 else (slot - width, st - 1 if (st - 1) % p != r else same)
                rows.append((slot, st, *row, none, same))
            elif kind == 1:
                up = (none, same) if st == n - 1 else (slot + width, st if (st + 1) % p != r else same)
                rows.append((slot, n + st, slot - n * width, same, *up))
            else:
                rows.append((slot, 2 * n + st, slot - n * width, same, none, same))
        out.append(rows)
    return out, none


def _peaks(schedule: Any, lists: list[list[tuple[int, int, int]]]) -> tuple[int, ...]:
    """Each rank's peak activation sets in flight: an F adds one, the action that frees it (W when backward is
    split, else B) drops one."""
    freeing = 2 if schedule.split_backward else 1
    peaks = []
    for acts in lists:
        held = peak = 0
        for _, kind, _ in acts:
            if kind == 0:
                held += 1
                peak = max(peak, held)
            elif kind == freeing:
                held -= 1
        peaks.append(peak)
    return tuple(peaks)
