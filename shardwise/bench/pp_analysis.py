"""``shardwise bench pp``, the pure part: from a measured timeline to costs, bubble and the simulator's prediction.

A timeline is a list of ``simulate.Event`` (rank, action, start, end) for the compute actions of one step, as
``Pipeline.timeline()`` returns measured ones and ``simulate`` returns simulated ones — so every function here
can be checked against a simulated timeline whose costs are known (tests/e2e/test_bench_pp.py does).

* **Measured bubble** = ``1 - sum(busy) / (p * makespan)``, busy = the compute actions' durations, makespan =
  last end - first start over all ranks (the same definition as ``SimResult.bubble_ratio``).
* **Costs** per stage: the median duration of its ``F``, ``B`` and ``W`` actions. In a schedule that does not
  split backward, ``B`` is the full backward; it is reported as ``B`` with ``W = 0`` (the simulator charges
  ``B + W`` for such a ``B``).
* **Communication** (one number, every boundary): the median over cross-rank dependencies *that the consumer
  waited for* (its rank's previous action had ended before the producer's) of ``consumer start - producer
  end``. It includes the transfer and the interpreter's work between the two computes (posting the send,
  waking the receive), which is what the simulator's ``comm`` stands for. No such wait: 0.
* **Prediction**: ``simulate(schedule, Costs(F, B, W, comm))`` with those numbers.
* **Fitted communication** (a diagnostic, not a prediction): the ``comm`` with which the simulator, given the
  same F/B/W, reproduces the measured makespan — the per-message delay the run behaved as if it had.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Sequence

from ..parallel.pipeline.actions import Schedule
from ..parallel.pipeline.simulate import Costs, Event, SimResult, dependencies, simulate

__all__ = ["BubbleReport", "measured_bubble", "stage_costs", "comm_estimate", "predict", "fit_comm", "analyse"]


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
    """Per-stage median durations ``(F, B, W)`` (each a tuple over stages); ``W`` is 0 where backward is whole."""
    out = []
    for kind in ("F", "B", "W"):
        row = []
        for s in range(schedule.num_stages):
            d = [e.end - e.start for e in events if e.action.stage == s and e.action.kind == kind]
            if not d and (kind != "W" or schedule.split_backward):
                raise ValueError(f"the timeline holds no {kind} action of stage {s}; pass one whole step's events "
                                 f"of schedule {schedule.name!r}")
            row.append(statistics.median(d) if d else 0.0)
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


def predict(schedule: Schedule, costs: Costs) -> SimResult:
    """The simulator's run of ``schedule`` with measured ``costs`` (``B`` of a whole-backward schedule: W = 0)."""
    return simulate(schedule, costs)


def fit_comm(schedule: Schedule, costs: Costs, makespan: float, iters: int = 40) -> float:
    """Smallest ``comm`` whose simulated makespan reaches ``makespan`` (bisection; the makespan does not
    decrease as comm grows). 0 when the costs alone already reach it."""
    def span(c: float) -> float:
        return predict(schedule, Costs(F=costs.F, B=costs.B, W=costs.W, comm=c)).makespan
    lo, hi = 0.0, max(makespan, 1e-12)
    if span(lo) >= makespan:
        return 0.0
    for _ in range(iters):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if span(mid) < makespan else (lo, mid)
    return hi


def analyse(events: Sequence[Event], schedule: Schedule) -> BubbleReport:
    """Measured bubble of one step's timeline and the prediction from its own costs."""
    bubble, makespan = measured_bubble(events, schedule.p)
    f, b, w = stage_costs(events, schedule)
    costs = Costs(F=f, B=b, W=w, comm=comm_estimate(events, schedule))
    sim = predict(schedule, costs)
    return BubbleReport(measured=bubble, predicted=sim.bubble_ratio, makespan=makespan,
                        predicted_makespan=sim.makespan, costs=costs, fitted_comm=fit_comm(schedule, costs, makespan))
