"""A pipeline flush on ranks that share a host's cores (CPU hosts with more ranks than cores). Pure.

The flush simulator (``flush_sim``) gives every rank a device of its own. On a host with ``C`` cores and more
busy ranks than cores the ranks share them: while some pipeline ranks idle (warm-up, drain, waiting for a
neighbour), the busy ones get the idle ones' share and run faster; while all are busy they run at the
calibrated (contended) speed. Graham's list-scheduling bound only brackets this; here it is simulated.

The model is processor sharing: at every instant the ``k`` busy ranks of the host each run at
``min(1, C / k)`` of a core (one compute thread per rank). Costs come calibrated with ``n`` ranks busy (speed
``min(1, C / n)``), so an action of calibrated cost ``c`` runs for ``c · share(n) / share(k)`` while ``k``
are busy. Every simulated pipeline rank stands for ``copies`` host ranks (its tensor-parallel peers and the
same pipeline rank of the other data-parallel replicas) that run the same actions at the same times. Boundary
transfers take their own time and use no core (the gloo copy is small next to a stage's work).

An event simulation: between two events (an action ends, a transfer lands) the busy set is fixed, so each busy
rank's remaining work falls linearly. O(actions × p) per flush; the planner runs it only for shared hosts.
"""

from __future__ import annotations

from typing import Any, Sequence

from .flush_sim import _compiled
from .pipeline_cost import _CAP, _schedule

__all__ = ["shared_makespan", "shared_flush_time"]

_INF = float("inf")


def shared_makespan(schedule: Any, F: Sequence[float], B: Sequence[float], W: Sequence[float],
                    comm: Sequence[float], cores: int, copies: float, calibrated: int) -> float:
    """Makespan of ``schedule`` (the actions of ``flush_sim``'s compiled order) when ``copies`` host ranks per
    pipeline rank share ``cores`` cores; ``F``/``B``/``W`` are calibrated with ``calibrated`` ranks busy."""
    order, p, _ = _compiled(schedule)
    n = len(F)
    split = schedule.split_backward
    costs = list(F) + [B[s] + (0.0 if split else W[s]) for s in range(n)] + list(W)
    links = [*comm[:n - 1], 0.0]
    queues: list[list[int]] = [[] for _ in range(p)]
    for i, action in enumerate(order):
        queues[action[0]].append(i)
    end = [_INF] * len(order) + [0.0]  # end[-1]: the "no dependency" sentinel
    base = min(1.0, cores / calibrated)
    head = [0] * p
    start = [_INF] * p  # when the rank's current action may run (inf: a dependency has not ended)
    left = [0.0] * p  # calibrated seconds of work left in the current action
    t = 0.0

    def arm(r: int, now: float) -> None:
        # the rank's next action: ready once both dependencies ended and their transfers landed
        if head[r] >= len(queues[r]):
            start[r] = _INF
            return
        _, c, a, la, b, lb = order[queues[r][head[r]]]
        ready = max(now, end[a] + links[la], end[b] + links[lb])
        start[r], left[r] = ready, costs[c]

    for r in range(p):
        arm(r, 0.0)
    remaining = len(order)
    while remaining:
        busy = [r for r in range(p) if start[r] <= t]
        if not busy:
            nxt = min(start)
            if nxt == _INF:
                raise ValueError(f"schedule {schedule.name!r} deadlocks under core sharing")
            t = nxt
            continue
        speed = min(1.0, cores / (len(busy) * copies)) / base  # calibrated seconds done per second
        step = min(left[r] for r in busy) / speed
        later = min((start[r] for r in range(p) if t < start[r] < _INF), default=_INF)
        step = min(step, later - t)
        t += step
        done = []
        for r in busy:
            left[r] -= step * speed
            if left[r] <= 1e-12 * (1.0 + costs[order[queues[r][head[r]]][1]]):
                done.append(r)
        for r in done:
            end[queues[r][head[r]]] = t
            head[r] += 1
            remaining -= 1
        # an ended action may release its own rank's next action and any rank waiting on it
        for r in range(p):
            if r in done or start[r] == _INF:
                arm(r, t)
    return t


def shared_flush_time(plan: Any, m: int, F: Sequence[float], B: Sequence[float], W: Sequence[float],
                      comm: Sequence[float], cores: int, n: int, calibrated: int) -> float:
    """One flush of ``plan``'s pipeline with ``m`` micro-batches on ``n`` ranks sharing ``cores`` cores. Long
    flushes are extended by the steady state's period, as ``pipeline_cost.simulate_flush`` does."""
    p, copies = plan.pp, n / plan.pp
    run = lambda k: shared_makespan(_schedule(plan.schedule, p, k, plan.chunks), F, B, W, comm,  # noqa: E731
                                    cores, copies, calibrated)
    cap = _CAP * p
    time = run(min(m, cap))
    if m > cap:
        time += (m - cap) * (run(cap + p) - time) / p
    return time
