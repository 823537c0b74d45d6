"""Stages and their timeline: which layers each pipeline stage runs, and the step of one flush from the
project's own schedule simulator (``shardwise.parallel.pipeline.simulate``) fed with per-stage F/B/W and
boundary transfer costs.

Simulating a flush of thousands of micro-batches action by action is slow and unnecessary: once every rank is
in its steady state, one more micro-batch adds exactly the bottleneck rank's work. So the flush is simulated
with ``m' = min(m, 4p)`` and ``m' + p`` micro-batches and extended by the period this measures (exact
once the schedule is periodic); the activation
sets in flight come from the same simulation (GPipe holds all ``m``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..parallel.pipeline.schedules import get_schedule
from ..parallel.pipeline.simulate import Costs, simulate
from ..parallel.pipeline.stage import balance_by_params
from .layers import Layer

__all__ = ["split_stages", "split_at", "Flush", "simulate_flush", "flush_lower_bound"]


def split_stages(layers: Sequence[Layer], stages: int, weights: Sequence[float] | None = None) -> list[list[Layer]]:
    """Contiguous stages minimising the heaviest one, by parameters (what ``sw.pipeline`` does by default) or by
    the given ``weights`` (e.g. predicted time); ``ValueError`` when there are fewer layers than stages."""
    if stages > len(layers):
        raise ValueError(f"pp × chunks = {stages} stages need at least {stages} layers; the model has {len(layers)} "
                         f"({[layer.name for layer in layers][:6]}...); use fewer pipeline stages")
    w = [int(x) for x in (weights if weights is not None else [layer.params for layer in layers])]
    starts = balance_by_params(w, stages)
    bounds = list(zip(starts, starts[1:] + [len(layers)]))
    return [list(layers[a:b]) for a, b in bounds]


def split_at(layers: Sequence[Layer], starts: Sequence[str]) -> list[list[Layer]]:
    """Stages that start at the layers named in ``starts`` (stage 0 starts at the first layer); ``ValueError``
    naming the unknown or out-of-order name."""
    names = [layer.name for layer in layers]
    cuts = [0]
    for name in starts:
        if name not in names:
            raise ValueError(f"pp_split names {name!r}, which is not a layer of the model; layers are "
                             f"{names[:4]} … {names[-2:]}")
        i = names.index(name)
        if i <= cuts[-1]:
            raise ValueError(f"pp_split {list(starts)} must name distinct layers in model order, after the first "
                             f"({names[0]!r}); {name!r} is out of order")
        cuts.append(i)
    bounds = list(zip(cuts, cuts[1:] + [len(layers)]))
    return [list(layers[a:b]) for a, b in bounds]


@dataclass(frozen=True)
class Flush:
    """One pipeline flush."""

    time: float
    busy: tuple[float, ...]
    """Compute of each rank over the flush."""
    in_flight: tuple[int, ...]
    """Activation sets (one chunk × one micro-batch) each rank holds at its peak."""


def simulate_flush(schedule: str, p: int, m: int, chunks: int, F: Sequence[float], B: Sequence[float],
                   W: Sequence[float], comm: Sequence[float]) -> Flush:
    """Time of one flush of ``m`` micro-batches; ``F``, ``B``, ``W`` per stage (``p × chunks``), ``comm`` per
    boundary. Schedules that do not split backward run ``B + W`` as one action."""
    if p == 1:
        per = sum(F) + sum(B) + sum(W)
        return Flush(time=m * per, busy=(m * per,), in_flight=(1,))
    cap = 4 * p
    costs = Costs(F=tuple(F), B=tuple(B), W=tuple(W), comm=tuple(comm))
    run = lambda k: simulate(get_schedule(schedule, p=p, m=k, chunks=chunks), costs)  # noqa: E731
    result = run(min(m, cap))
    per_rank = [sum(F[s] + B[s] + W[s] for s in range(r, p * chunks, p)) for r in range(p)]
    time, extra = result.makespan, 0
    if m > cap:
        # the steady state repeats every p micro-batches: measure one period and extend by it
        period = run(cap + p).makespan - result.makespan
        extra = m - cap
        time = result.makespan + extra * period / p
        # a period measured before zero-bubble schedules settle can undershoot the bottleneck rank's work
        time = max(time, flush_lower_bound(schedule, p, m, chunks, F, B, W, comm))
    busy = tuple(b + extra * w for b, w in zip(result.busy, per_rank))
    held = tuple(m * chunks if schedule == "gpipe" else k for k in result.peak_in_flight)
    return Flush(time=time, busy=busy, in_flight=held)


def flush_lower_bound(schedule: str, p: int, m: int, chunks: int, F: Sequence[float], B: Sequence[float],
                      W: Sequence[float], comm: Sequence[float]) -> float:
    """A time ``simulate_flush`` can never beat, without simulating (the search prunes with it).

    Rank ``r`` runs ``m`` micro-batches of its stages' work in series and cannot start before micro-batch 0
    has crossed stages ``0 … r-1`` (its first stage is ``r``). With one chunk per rank and backward not split
    (gpipe, 1f1b) its last action is the last micro-batch's backward, after which stages ``r-1 … 0`` still
    run theirs. The bound is the largest such sum over the ranks."""
    if p == 1:
        return m * (sum(F) + sum(B) + sum(W))
    n = p * chunks
    best = 0.0
    for r in range(p):
        busy = m * sum(F[s] + B[s] + W[s] for s in range(r, n, p))
        fill = sum(F[s] + comm[s] for s in range(r))
        drain = sum(B[s] + W[s] + comm[s] for s in range(r)) if schedule in ("gpipe", "1f1b") else 0.0
        best = max(best, fill + busy + drain)
    return best
