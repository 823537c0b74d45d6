"""``shardwise bench pp``, the pure part: from a measured timeline to costs, bubble and the simulator's prediction.

A timeline is a list of ``simulate.Event`` (rank, action, start, end) for the compute actions of one step, as
``Pipeline.timeline()`` returns measured ones and ``simulate`` returns simulated ones — so every function here
can be checked against a simulated timeline whose costs are known (tests/e2e/test_bench_pp.py does).

* **Measured bubble** = ``1 - sum(busy) / (p * makespan)``, busy = the compute actions' durations, makespan =
  last end - first start over all ranks (the same definition as ``SimResult.bubble_ratio``).
* **Costs** per stage: the mean duration of its ``F``, ``B`` and ``W`` actions — the mean, not the median, so
  that the simulated busy time equals the measured one (on a shared host durations have a long right tail;
  medians under-stated the step's compute by 1–4 %). In a schedule that does not
  split backward, ``B`` is the full backward; it is reported as ``B`` with ``W = 0`` (the simulator charges
  ``B + W`` for such a ``B``).
* **Communication** (one number, every boundary): the median over cross-rank dependencies *that the consumer
  waited for* (its rank's previous action had ended before the producer's) of ``consumer start - producer
  end``. It includes the transfer and the interpreter's work between the two computes (posting the send,
  waking the receive), which is what the simulator's ``comm`` stands for. No such wait: 0.
* **Host time** (``host_costs``): what a rank does between two compute actions when it is not waiting for a
  message — the interpreter's bookkeeping (``overhead``, per compute action) and posting each send and receive
  the lowered schedule places there (``post``, per message; ~0.1 ms per gloo call on the 2-core VM). Fitted
  by least squares on those gaps against the number of communication actions in them. The rank is occupied
  but not computing: the simulator charges it the same way (``Costs.overhead`` / ``Costs.post``).
* **Prediction**: ``simulate(lowered schedule, Costs(F, B, W, comm, overhead, post))`` with those numbers.
* **Fitted communication** (a diagnostic, not a prediction): the ``comm`` with which the simulator, given the
  same F/B/W, reproduces the measured makespan — the per-message delay the run behaved as if it had.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from ..parallel.pipeline.actions import Schedule
from ..parallel.pipeline.simulate import Costs, Event, SimResult, dependencies, simulate

__all__ = ["BubbleReport", "measured_bubble", "stage_costs", "comm_estimate", "host_costs", "predict", "fit_comm",
           "analyse"]


@dataclass(frozen=True)
class BubbleReport:
    """One step's measured bubble against the simulator's prediction from that step's own costs."""

    measured: float
    """1 - busy / (p * makespan) of the measured timeline."""
    predicted: float
    """The simulator's bubble ratio with the measured per-stage costs."""
    makespan: float
    """Measured step time of the compute timeline (seconds, first start to last end)."""
    predicted_makespan: float
    costs: Costs
    """Per-stage median F/B/W (seconds) and the communication estimate."""
    fitted_comm: float = 0.0
    """The comm (seconds) that makes the simulated makespan equal the measured one (``fit_comm``)."""

    @property
    def rel_diff(self) -> float:
        """(measured - predicted) / predicted; 0 when both are 0."""
        if self.predicted == 0:
            return 0.0 if self.measured == 0 else float("inf")
        return (self.measured - self.predicted) / self.predicted


def measured_bubble(events: Sequence[Event], p: int) -> tuple[float, float]:
    """(bubble ratio, makespan) of a timeline of compute actions on ``p`` ranks."""
    if not events:
        raise ValueError("an empty timeline has no bubble; run a pipeline step first")
    makespan = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in events)
    return (1.0 - busy / (p * makespan) if makespan > 0 else 0.0), makespan


def stage_costs(events: Sequence[Event], schedule: Schedule) -> tuple[tuple[float, ...], ...]:
    """Per-stage mean durations ``(F, B, W)`` (each a tuple over stages); ``W`` is 0 where backward is whole."""
    out = []
    for kind in ("F", "B", "W"):
        row = []
        for s in range(schedule.num_stages):
            d = [e.end - e.start for e in events if e.action.stage == s and e.action.kind == kind]
            if not d and (kind != "W" or schedule.split_backward):
                raise ValueError(f"the timeline holds no {kind} action of stage {s}; pass one whole step's events "
                                 f"of schedule {schedule.name!r}")
            row.append(statistics.fmean(d) if d else 0.0)
        out.append(tuple(row))
    return tuple(out)


def comm_estimate(events: Sequence[Event], schedule: Schedule) -> float:
    """Median gap between a cross-rank producer's end and its waiting consumer's start (see module doc)."""
    end = {e.action: e.end for e in events}
    by_rank: dict[int, list[Event]] = {}
    for e in sorted(events, key=lambda e: e.start):
        by_rank.setdefault(e.rank, []).append(e)
    gaps = []
    for rank_events in by_rank.values():
        prev_end = float("-inf")
        for e in rank_events:
            cross = [end[d] for d in dependencies(e.action, schedule)
                     if d in end and schedule.rank_of(d.stage) != e.rank]
            local = [end[d] for d in dependencies(e.action, schedule)
                     if d in end and schedule.rank_of(d.stage) == e.rank]
            if cross and max(cross) >= max([prev_end, *local]):  # this rank sat waiting for the message
                gaps.append(max(0.0, e.start - max(cross)))
            prev_end = e.end
    return statistics.median(gaps) if gaps else 0.0


def host_costs(events: Sequence[Event], lowered: Schedule, comm: float = 0.0) -> tuple[float, float]:
    """``(overhead, post)``: host seconds per compute action and per posted message, fitted on the gaps between
    consecutive compute actions of a rank that were not waiting for a message (every cross-rank input had
    arrived, ``comm`` after its producer's end, before the previous action ended). ``lowered`` is the schedule
    the executor ran (with its send/receive actions). Least squares of gap on message count over the medians
    per count (weighted by how many gaps each has); a negative coefficient is clamped at 0 and the other refit."""
    end = {e.action: e.end for e in events}
    by_count: dict[int, list[float]] = {}
    for r, acts in enumerate(lowered.ranks):
        between: dict = {}
        for a in acts:  # messages posted after each compute action, before the next one
            if a.is_compute:
                between[a] = 0
                last = a
            elif between:
                between[last] += 1
        mine = sorted((e for e in events if e.rank == r), key=lambda e: e.start)
        for prev, e in zip(mine, mine[1:]):
            cross = [end[d] + comm for d in dependencies(e.action, lowered)
                     if d in end and lowered.rank_of(d.stage) != r]
            if max(cross, default=float("-inf")) <= prev.end and prev.action in between:
                by_count.setdefault(between[prev.action], []).append(max(0.0, e.start - prev.end))
    return _fit_line({k: (statistics.median(v), len(v)) for k, v in by_count.items()})


def _fit_line(points: dict[int, tuple[float, int]]) -> tuple[float, float]:
    """Weighted least squares ``y = a + b k`` over ``{k: (y, weight)}`` with ``a, b >= 0``."""
    if not points:
        return 0.0, 0.0
    w = sum(n for _, n in points.values())
    mk = sum(k * n for k, (_, n) in points.items()) / w
    my = sum(y * n for y, n in points.values()) / w
    skk = sum(n * (k - mk) ** 2 for k, (_, n) in points.items())
    b = sum(n * (k - mk) * (y - my) for k, (y, n) in points.items()) / skk if skk > 0 else 0.0
    a = my - b * mk
    if b < 0:
        return max(my, 0.0), 0.0
    if a < 0:  # through the origin
        kk = sum(n * k * k for k, (_, n) in points.items())
        return 0.0, (sum(n * k * y for k, (y, n) in points.items()) / kk if kk > 0 else 0.0)
    return a, b


def predict(schedule: Schedule, costs: Costs) -> SimResult:
    """The simulator's run of ``schedule`` with measured ``costs`` (``B`` of a whole-backward schedule: W = 0)."""
    return simulate(schedule, costs)


def fit_comm(schedule: Schedule, costs: Costs, makespan: float, iters: int = 40) -> float:
    """Smallest ``comm`` whose simulated makespan reaches ``makespan`` (bisection; the makespan does not
    decrease as comm grows). 0 when the costs alone already reach it."""
    def span(c: float) -> float:
        return predict(schedule, Costs(F=costs.F, B=costs.B, W=costs.W, comm=c, overhead=costs.overhead,
                                       post=costs.post)).makespan
    lo, hi = 0.0, max(makespan, 1e-12)
    if span(lo) >= makespan:
        return 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < makespan else (lo, mid)
    return hi


def analyse(events: Sequence[Event], schedule: Schedule, lowered: Schedule | None = None) -> BubbleReport:
    """Measured bubble of one step's timeline and the prediction from its own costs. With ``lowered`` (the
    schedule with send/receive actions that ran) the host time between actions is fitted and simulated too;
    without it, compute and communication only."""
    bubble, makespan = measured_bubble(events, schedule.p)
    f, b, w = stage_costs(events, schedule)
    comm = comm_estimate(events, schedule)
    overhead, post = host_costs(events, lowered, comm) if lowered is not None else (0.0, 0.0)
    costs = Costs(F=f, B=b, W=w, comm=comm, overhead=overhead, post=post)
    schedule = lowered if lowered is not None else schedule
    sim = predict(schedule, costs)
    return BubbleReport(measured=bubble, predicted=sim.bubble_ratio, makespan=makespan,
                        predicted_makespan=sim.makespan, costs=costs, fitted_comm=fit_comm(schedule, costs, makespan))
