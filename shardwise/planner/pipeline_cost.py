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

import bisect
import itertools
from dataclasses import dataclass
from typing import Sequence

from ..parallel.pipeline.schedules import SCHEDULES

from ..parallel.pipeline.stage import balance_by_params
from .flush_sim import fast_simulate
from .layers import Layer

__all__ = ["split_stages", "split_at", "Flush", "simulate_flush", "flush_lower_bound", "flush_terms", "bound_of_terms",
           "first_rank_in_flight", "held_bytes", "first_forwards"]


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


def balance_minmax(weights: Sequence[float], n: int) -> list[int]:
    """Start indices of ``n`` contiguous non-empty parts minimising the heaviest part — the optimum of
    ``balance_by_params`` in O(len · log) instead of O(n · len²) (the search cuts thousands of pipelines).

    Bisects the heaviest-part value; a greedy pass decides whether a value is reachable (pack each part up to
    the value, keeping one unit for every part still to come)."""
    k = len(weights)
    if not 1 <= n <= k:
        raise ValueError(f"cannot cut {k} layers into {n} non-empty stages")

    prefix = list(itertools.accumulate(weights, initial=0.0))  # prefix[i]: weight of layers 0 … i-1

    total, search = prefix[k], bisect.bisect_right

    def cuts(limit: float) -> list[int] | None:
        # greedy: each part takes the most layers whose sum stays within the limit while leaving one layer for
        # every part still to come (a binary search on the prefix sums per part, not a pass per layer). What is
        # left clearly over the parts left times the limit fits no cut: give up early (the margin keeps this to
        # cases the full pass rejects too, whatever the rounding of the prefix sums)
        starts, i = [0], 0
        for part in range(1, n):
            start = prefix[i]
            if total - start > (n - part + 1) * limit * (1 + 1e-9):
                return None
            j = search(prefix, start + limit, i + 1) - 1  # prefix[i] <= start + limit: the answer is above i
            last = k - (n - part)
            if j > last:
                j = last
            if j <= i:
                return None  # layer i alone is over the limit
            starts.append(j)
            i = j
        return starts if total - prefix[i] <= limit else None

    # the optimum lies in [max(heaviest layer, mean part), mean part + heaviest layer]: a greedy part that
    # cannot take its next layer already holds more than the mean
    def heaviest(starts: list[int]) -> float:
        return max(prefix[b] - prefix[a] for a, b in zip(starts, starts[1:] + [k]))

    lo = max(max(weights), prefix[k] / n)
    best = cuts(lo + max(weights)) or cuts(float(prefix[k]))
    assert best is not None
    hi = heaviest(best)  # a reachable heaviest part: the bisection moves ``hi`` to each cut's real heaviest part
    for _ in range(60):
        if hi - lo <= 1e-4 * hi:  # cuts this close in heaviest-stage time are the same plan to the planner
            break
        mid = (lo + hi) / 2
        found = cuts(mid)
        if found is None:
            lo = mid
        else:
            hi, best = heaviest(found), found
    assert best is not None
    return best


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


_CAP = 4
"""Micro-batches simulated per flush, in units of ``p`` (longer flushes extend the steady state by its period)."""


def simulate_flush(schedule: str, p: int, m: int, chunks: int, F: Sequence[float], B: Sequence[float],
                   W: Sequence[float], comm: Sequence[float]) -> Flush:
    """Time of one flush of ``m`` micro-batches; ``F``, ``B``, ``W`` per stage (``p × chunks``), ``comm`` per
    boundary. Schedules that do not split backward run ``B + W`` as one action."""
    if p == 1:
        per = sum(F) + sum(B) + sum(W)
        return Flush(time=m * per, busy=(m * per,), in_flight=(1,))
    cap = _CAP * p
    run = lambda k: fast_simulate(_schedule(schedule, p, k, chunks), F, B, W, comm)  # noqa: E731
    makespan, busy0, peaks = run(min(m, cap))
    per_rank = [sum(F[s] + B[s] + W[s] for s in range(r, p * chunks, p)) for r in range(p)]
    time, extra = makespan, 0
    if m > cap:
        # the steady state repeats every p micro-batches: measure one period and extend by it
        period = run(cap + p)[0] - makespan
        extra = m - cap
        time = makespan + extra * period / p
        # a period measured before zero-bubble schedules settle can undershoot the bottleneck rank's work
        time = max(time, flush_lower_bound(schedule, p, m, chunks, F, B, W, comm))
    busy = tuple(b + extra * w for b, w in zip(busy0, per_rank))
    held = tuple(m * chunks if schedule == "gpipe" else k for k in peaks)
    return Flush(time=time, busy=busy, in_flight=held)


def first_rank_in_flight(schedule: str, p: int, m: int, chunks: int) -> int:
    """``simulate_flush(...).in_flight[0]`` without building the schedule: the activation sets pipeline rank 0
    holds at its peak (the search's memory bound needs it for thousands of plans; tested equal to the
    simulation). Rank 0 starts with the most warm-up forwards of any rank in every schedule here."""
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m * chunks
    k = min(m, _CAP * p)  # the flush ``simulate_flush`` counts its peaks on
    if schedule in ("1f1b", "zb-h1"):
        return min(p, k)  # p - 1 warm-up forwards, then one more before the first backward (or weight gradient)
    if schedule == "zb-h2":
        return min(2 * p - 1, k)  # 2p - 1 warm-up forwards; each steady B W F frees one set and takes one
    total = k * chunks  # interleaved: Megatron's warm-up, then one forward before the first backward
    return total if k == p else min(2 * (p - 1) + (chunks - 1) * p + 1, total)


def first_forwards(p: int, chunks: int, count: int) -> tuple[int, ...]:
    """How many of pipeline rank 0's first ``count`` forwards each of its chunks runs, in Megatron's interleaved
    order (micro-batches in groups of ``p`` per chunk: forward ``i`` runs chunk ``(i mod p·chunks) // p``; one
    chunk: all of them). Before its first backward, rank 0 holds exactly these sets: the memory bounds count them
    by chunk (``bounds.memory_bounds``) without building the schedule."""
    if chunks == 1:
        return (count,)
    out = [0] * chunks
    for i in range(count):
        out[(i % (p * chunks)) // p] += 1
    return tuple(out)


_HELD_CACHE: dict[tuple, tuple[float, ...]] = {}


def held_bytes(schedule: str, p: int, m: int, chunks: int, stage_bytes: Sequence[float]) -> tuple[float, ...]:
    """Per pipeline rank, the most activation bytes it holds at once in a flush: a forward of stage ``s`` adds
    ``stage_bytes[s]`` (one micro-batch's kept activations of that stage), the action that frees them (backward,
    or the weight gradient where backward is split) drops them. Which sets are live together is the schedule's
    order, so chunks of unequal size — an embedding-only or a head-only chunk, whose fp32 logits can outweigh a
    block — count as they are, not as the peak count × their mean (Megatron's interleaved order on p = 2, V = 2,
    m = 4 holds 3 sets of chunk 0 and 2 of chunk 1 at its peak count, but 4 + 1 a moment later). Over
    ``simulate_flush``'s flush of ``min(m, 4p)`` micro-batches (a longer steady state holds no more); gpipe holds
    every forward of the flush."""
    n = p * chunks
    if len(stage_bytes) != n:
        raise ValueError(f"held_bytes needs one entry per stage (pp × chunks = {n}), got {len(stage_bytes)}")
    if p == 1 or schedule == "gpipe":
        return tuple((1 if p == 1 else m) * float(sum(stage_bytes[r::p])) for r in range(p))
    k = min(m, _CAP * p)
    key = (schedule, p, k, chunks, tuple(stage_bytes))
    hit = _HELD_CACHE.get(key)
    if hit is None:
        sched = _schedule(schedule, p, k, chunks)
        freeing = "W" if getattr(sched, "split_backward", False) else "B"
        peaks = []
        for acts in sched.ranks:  # type: ignore[attr-defined]
            held = peak = 0.0
            for a in acts:
                if a.kind == "F":
                    held += stage_bytes[a.stage]
                    peak = max(peak, held)
                elif a.kind == freeing:
                    held -= stage_bytes[a.stage]
            peaks.append(peak)
        if len(_HELD_CACHE) > 256:
            _HELD_CACHE.clear()
        hit = _HELD_CACHE[key] = tuple(peaks)
    return hit


_SCHEDULE_CACHE: dict[tuple[str, int, int, int], object] = {}


def _schedule(name: str, p: int, m: int, chunks: int) -> object:
    """The schedule's actions, memoised per shape. Built by the generator directly: ``get_schedule``'s full
    validation (every dependency, every rank; ``tests/unit/test_pipeline_schedules.py`` runs it on each
    generator) costs more than the simulation the planner needs."""
    key = (name, p, m, chunks)
    if key not in _SCHEDULE_CACHE:
        if len(_SCHEDULE_CACHE) > 256:
            _SCHEDULE_CACHE.clear()
        generator, _ = SCHEDULES[name]
        _SCHEDULE_CACHE[key] = generator(p, m, chunks)
    return _SCHEDULE_CACHE[key]


def flush_lower_bound(schedule: str, p: int, m: int, chunks: int, F: Sequence[float], B: Sequence[float],
                      W: Sequence[float], comm: Sequence[float]) -> float:
    """A time ``simulate_flush`` can never beat, without simulating (the search prunes with it).

    Rank ``r`` runs ``m`` micro-batches of its stages' work in series and cannot start before micro-batch 0
    has crossed stages ``0 … r-1`` (its first stage is ``r``). Where backward is not split (gpipe, 1f1b,
    interleaved) its last action is the last micro-batch's backward of stage ``r``, after which stages
    ``r-1 … 0`` still run theirs. The bound is the largest such sum over the ranks."""
    if p == 1:
        return m * (sum(F) + sum(B) + sum(W))
    return bound_of_terms(schedule, m, flush_terms(p, chunks, F, B, W, comm))


FlushTerms = tuple[list[float], list[float], list[float]]
"""Per pipeline rank: its stages' work for one micro-batch, the fill before it, and the fill plus drain."""


def flush_terms(p: int, chunks: int, F: Sequence[float], B: Sequence[float], W: Sequence[float],
                comm: Sequence[float]) -> FlushTerms:
    """What ``flush_lower_bound`` needs of the costs, for any schedule and micro-batch count (the search bounds
    several of each on one stage split)."""
    n = p * chunks
    work = [f + b + w for f, b, w in zip(F, B, W)]
    sums = [sum(work[r::p]) for r in range(p)]
    fill, drain = [], []
    edge_fill = edge_drain = 0.0  # fill (+ drain) of stages 0 … r-1
    for r in range(p):
        fill.append(edge_fill)
        drain.append(edge_drain)
        edge_fill += F[r] + comm[r] + 0.0 if r < n - 1 else 0.0
        edge_drain += F[r] + comm[r] + (B[r] + W[r] + comm[r]) if r < n - 1 else 0.0
    return sums, fill, drain


def bound_of_terms(schedule: str, m: int, terms: FlushTerms) -> float:
    """``flush_lower_bound`` of ``m`` micro-batches from ``flush_terms``."""
    sums, fill, drain = terms
    # gpipe, 1f1b and Megatron's interleaved order end each rank on its first stage's backward of the last
    # micro-batch; zero-bubble schedules may end on deferred weight gradients instead
    edges = drain if schedule in ("gpipe", "1f1b", "interleaved") else fill
    best = 0.0
    for work, edge in zip(sums, edges):
        best = max(best, edge + m * work)
    return best
