"""Discrete-event simulation of a pipeline schedule: step time, bubble, activations in flight, deadlocks.

Each rank executes its compute actions in list order, one at a time; an action starts when its rank is free
and its dependencies have finished (plus the communication time when a dependency ran on another rank):

* ``F(s, i)`` needs ``F(s-1, i)`` (the stage input);
* ``B(s, i)`` needs ``F(s, i)`` and ``B(s+1, i)`` (the gradient of the stage output);
* ``W(s, i)`` needs ``B(s, i)``.

Communication is the latency ``comm`` on cross-rank dependencies. Explicit send/receive actions (a schedule
lowered by ``communication.lower_communication``) take no time of their own unless ``Costs.post`` is set: then
each one occupies its rank for ``post`` seconds where the executor runs it (after the compute action before
it), as posting a message does on a host that drives the transport itself (CPU ranks: ~0.1 ms per gloo
``isend``/``irecv`` call). ``Costs.overhead`` is the interpreter's own time after every compute action.
Neither counts as busy (compute) time, so both show in the bubble, as they do in a measured timeline.
When no rank can start its next action and some actions are left, the schedule deadlocks: ``simulate``
raises ``ScheduleDeadlock`` with the step x rank grid, the blocked actions marked, instead of hanging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from .actions import Action, Schedule

__all__ = ["Costs", "Event", "SimResult", "ScheduleDeadlock", "simulate", "dependencies"]

PerStage = Union[float, Sequence[float]]


@dataclass(frozen=True)
class Costs:
    """Time of each action kind for one micro-batch on one stage, and of one boundary transfer.

    Each field is a number (every stage alike) or a sequence with one entry per stage (``comm``: one per
    boundary ``s -> s+1``, ``num_stages - 1`` entries). In schedules that do not split backward, a ``B``
    action is the full backward and costs ``B + W``. For interleaved schedules these are per-chunk costs:
    divide a rank's costs by ``chunks`` to compare with 1F1B on the same model (``Costs.per_chunk``).
    """

    F: PerStage = 1.0
    """Forward time."""
    B: PerStage = 1.0
    """Input-gradient time (the part of backward the previous stage waits for)."""
    W: PerStage = 1.0
    """Weight-gradient time."""
    comm: PerStage = 0.0
    """Time to move one activation (forward) or one activation gradient (backward) across a boundary."""
    overhead: PerStage = 0.0
    """Host time a rank spends after each compute action of that stage before it can start anything else
    (the interpreter's bookkeeping): occupies the rank, is not compute."""
    post: float = 0.0
    """Host time to post one send or receive (each explicit communication action of a lowered schedule, where
    the executor runs it); 0 for a compute-only schedule, whose lists hold no such actions."""

    def per_chunk(self, chunks: int) -> "Costs":
        """The costs of one of ``chunks`` equal model chunks (compute divided by ``chunks``, comm unchanged)."""
        scale = lambda v: v / chunks if isinstance(v, (int, float)) else tuple(x / chunks for x in v)  # noqa: E731
        return Costs(F=scale(self.F), B=scale(self.B), W=scale(self.W), comm=self.comm, overhead=self.overhead,
                     post=self.post)

    def resolve(self, num_stages: int) -> dict[str, tuple[float, ...]]:
        """Per-stage tuples for ``F``, ``B``, ``W`` and per-boundary ``comm``; ``ValueError`` on bad values."""
        out = {}
        for name, n in (("F", num_stages), ("B", num_stages), ("W", num_stages), ("comm", max(num_stages - 1, 0)),
                        ("overhead", num_stages)):
            value = getattr(self, name)
            values = (float(value),) * n if isinstance(value, (int, float)) else tuple(float(v) for v in value)
            if len(values) != n:
                raise ValueError(f"cost {name} needs one value per {'boundary' if name == 'comm' else 'stage'} "
                                 f"({n} for {num_stages} stages), got {len(values)}: {value!r}")
            if any(v < 0 for v in values):
                raise ValueError(f"cost {name} must be >= 0, got {value!r}")
            out[name] = values
        if not self.post >= 0:
            raise ValueError(f"cost post must be >= 0, got {self.post!r}")
        return out


@dataclass(frozen=True)
class Event:
    """One executed action on the timeline."""

    rank: int
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What ``simulate`` reports for one step."""

    schedule: Schedule
    costs: Costs
    makespan: float
    """Step time: the end of the last action."""
    busy: tuple[float, ...]
    """Compute time of each rank."""
    peak_in_flight: tuple[int, ...]
    """Per rank, the most (stage, micro-batch) activation sets held at once: one is taken by ``F`` and freed
    by ``W`` in split schedules, by ``B`` otherwise. With chunks > 1 a set is one chunk's activations."""
    timeline: tuple[Event, ...]
    """Every compute action with its start and end, in order of start."""

    @property
    def idle(self) -> tuple[float, ...]:
        """Idle (bubble) time of each rank within the step."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_ratio(self) -> float:
        """Idle compute over available compute: ``sum(idle) / (p * makespan)``."""
        total = self.schedule.p * self.makespan
        return sum(self.idle) / total if total > 0 else 0.0

    def summary(self) -> str:
        s = self.schedule
        lines = [f"schedule {s.name}: p={s.p} m={s.m} chunks={s.chunks} "
                 f"({'B and W split' if s.split_backward else 'full backward'})",
                 f"step time     {self.makespan:.4g}",
                 f"bubble ratio  {self.bubble_ratio:.4f}"]
        for r in range(s.p):
            lines.append(f"rank {r}: busy {self.busy[r]:.4g}  idle {self.idle[r]:.4g}  "
                         f"peak in flight {self.peak_in_flight[r]}")
        return "\n".join(lines)


class ScheduleDeadlock(ValueError):
    """A schedule in which some rank waits for an action that can never run; ``blocked`` maps rank -> step."""

    def __init__(self, message: str, blocked: dict[int, int]) -> None:
        super().__init__(message)
        self.blocked = blocked


def dependencies(action: Action, schedule: Schedule) -> list[Action]:
    """The compute actions ``action`` must wait for (see module doc)."""
    s, i, last = action.stage, action.microbatch, schedule.num_stages - 1
    if action.kind == "F":
        return [Action(s - 1, "F", i)] if s > 0 else []
    if action.kind == "B":
        return [Action(s, "F", i)] + ([Action(s + 1, "B", i)] if s < last else [])
    if action.kind == "W":
        return [Action(s, "B", i)]
    raise AssertionError(f"not a compute action: {action}")


def simulate(schedule: Schedule, costs: Costs | None = None) -> SimResult:
    """Run ``schedule`` with ``costs`` (default F = B = W = 1, comm = 0); pure, no communication.

    Raises ``ValueError`` for an invalid schedule and ``ScheduleDeadlock`` when it cannot finish.
    """
    costs = costs or Costs()
    schedule.validate()
    table = costs.resolve(schedule.num_stages)
    lists = [[a for a in acts if a.is_compute] for acts in schedule.ranks]
    lead, after = _host_time(schedule, table, costs.post)
    end: dict[Action, float] = {}
    pos = [0] * schedule.p
    free = list(lead)
    events: list[Event] = []
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(lists):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                ready = _ready_time(a, schedule, table, end)
                if ready is None:
                    break
                start = max(free[r], ready)
                end[a] = start + _duration(a, schedule, table)
                free[r] = end[a] + after[r][pos[r]]
                events.append(Event(r, a, start, end[a]))
                pos[r] += 1
                progress = True
    if any(pos[r] < len(lists[r]) for r in range(schedule.p)):
        raise _deadlock(schedule, lists, pos, end)
    busy = tuple(sum(e.end - e.start for e in events if e.rank == r) for r in range(schedule.p))
    # The step ends with the last compute action: host time after it (the last sends' posting) is not waited
    # for, as a measured timeline's makespan (first start to last compute end) does not include it either.
    return SimResult(schedule=schedule, costs=costs, makespan=max((e.end for e in events), default=0.0), busy=busy,
                     peak_in_flight=tuple(_peak(acts, schedule.split_backward) for acts in lists),
                     timeline=tuple(sorted(events, key=lambda e: (e.start, e.rank))))


def _host_time(schedule: Schedule, table: dict[str, tuple[float, ...]],
               post: float) -> tuple[list[float], list[list[float]]]:
    """Per rank: the host time before its first compute action (posting the receives the list opens with) and,
    for its k-th compute action, the time after it before the next one can start (``overhead`` of its stage
    plus ``post`` per communication action that follows it in the list)."""
    lead, after = [], []
    for acts in schedule.ranks:
        head, tails = 0.0, []
        for a in acts:
            if a.is_compute:
                tails.append(table["overhead"][a.stage])
            elif tails:
                tails[-1] += post
            else:
                head += post
        lead.append(head)
        after.append(tails)
    return lead, after


def _duration(a: Action, schedule: Schedule, table: dict[str, tuple[float, ...]]) -> float:
    if a.kind == "B" and not schedule.split_backward:
        return table["B"][a.stage] + table["W"][a.stage]  # full backward
    return table[a.kind][a.stage]


def _ready_time(a: Action, schedule: Schedule, table: dict[str, tuple[float, ...]],
                end: dict[Action, float]) -> float | None:
    """When ``a``'s inputs are available on its rank, or ``None`` while a dependency has not run."""
    ready = 0.0
    for dep in dependencies(a, schedule):
        if dep not in end:
            return None
        cross = schedule.rank_of(dep.stage) != schedule.rank_of(a.stage)
        ready = max(ready, end[dep] + (table["comm"][min(a.stage, dep.stage)] if cross else 0.0))
    return ready


def _peak(actions: list[Action], split: bool) -> int:
    # walk the rank's own order: +1 when F takes a set, -1 when its freeing action completes
    freeing = "W" if split else "B"
    held = peak = 0
    for a in actions:
        if a.kind == "F":
            held += 1
            peak = max(peak, held)
        elif a.kind == freeing:
            held -= 1
    return peak


def _deadlock(schedule: Schedule, lists: list[list[Action]], pos: list[int],
              end: dict[Action, float]) -> ScheduleDeadlock:
    where = {a: (r, i) for r, acts in enumerate(lists) for i, a in enumerate(acts)}
    blocked = {r: pos[r] for r in range(schedule.p) if pos[r] < len(lists[r])}
    lines = [f"pipeline schedule {schedule.name!r} (p={schedule.p}, m={schedule.m}, chunks={schedule.chunks}) "
             f"deadlocks: no rank can start its next action."]
    for r, step in blocked.items():
        a = lists[r][step]
        for dep in (d for d in dependencies(a, schedule) if d not in end):
            dr, dstep = where[dep]
            lines.append(f"  rank {r} step {step}: {a} waits for {dep}, which rank {dr} runs at its step {dstep} "
                         f"but rank {dr} is stuck at step {blocked[dr]} ({lists[dr][blocked[dr]]})")
    lines.append("fix: reorder the actions so that every dependency runs earlier than what waits on it "
                 "(F(s,i) after F(s-1,i); B(s,i) after F(s,i) and B(s+1,i); W(s,i) after B(s,i)).")
    # mark positions in the full (communication-included) lists
    marks = {}
    for r, step in blocked.items():
        full_index = [i for i, a in enumerate(schedule.ranks[r]) if a.is_compute][step]
        marks[(r, full_index)] = " <blocked"
    lines.append("step x rank grid (compute actions after each blocked one never ran):")
    lines.append(schedule.grid(marks))
    return ScheduleDeadlock("\n".join(lines), blocked)
