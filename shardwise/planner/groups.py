"""Candidates expanded on demand: the search bounds whole groups before it bounds single plans.

A **group** is every plan of one ``(tp, pp, dp, recomputation, sequence parallelism, micro-batch)``: they share
their layer costs and differ in ZeRO stage, schedule, chunks and gradient accumulation. Its ``time_lb`` needs
no stage split and no schedule: a step runs ``per / mb`` micro-batches through the whole model, spread over
``pp`` ranks at best evenly, so no pipeline rank computes less than ``per / mb × (F + B + W of the model) / pp``;
the optimizer and the exposed data-parallel communication, both increasing in the parameters a rank holds, are
at least those of ``1/pp`` of the model's parameters (the least over the group's ZeRO stages). Every candidate
bound of the group (``enumerate._bounds``) is at least this (tested), so a group whose bound is no better than
the K-th best prediction holds no plan of the top K and is never expanded. A pipeline adds its fill: rank ``r``
starts after micro-batch 0's forward through the ``r`` stages before it (at least the ``r`` cheapest layers),
and the slowest rank ends no earlier than the ranks' mean start plus their mean work (not on a CPU host whose
ranks share cores: there the flush bound is the mean work alone).

That bound sees neither the stage split nor memory, and most groups it lets through hold no plan of the top K:
their fast schedules do not fit (an interleaved pipeline holds many micro-batches) and what fits is slow. So a
group whose bound comes up is first *reached*: ``group_least`` computes the exact least bound of its candidates
within the memory budget (per schedule option and ZeRO stage, on one ``Plan`` per ZeRO stage, no candidate
made), and the group waits in a second heap on that number; only when it comes up there are its candidates
made and queued for prediction (at 1,024 devices for GPT-3: ~390 groups reached, a handful expanded). The
micro-batch early stop is applied when a group is reached, in the order of the first bound, as before.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

from .bounds import Option, memory_bounds, split_id, time_bound
from .enumerate import (_MB_STOP, Candidate, Pool, Space, _expand_mb, _note, _schedule_options, _split, layouts,
                        note_mb_stop, note_over_memory, variants)
from .hardware import Hardware
from .memory import local_params
from .plan import Plan
from .predict import _dp_comm, _hardware_for, _optimizer, layer_costs, shares_cores
from .spec import ModelSpec

__all__ = ["Group", "LazyPool"]


@dataclass(frozen=True, order=True)
class Group:
    time_lb: float
    order: int
    """Construction order (ties and the micro-batch early stop follow it)."""
    tp: int = field(compare=False)
    pp: int = field(compare=False)
    dp: int = field(compare=False)
    per: int = field(compare=False)
    mb: int = field(compare=False)
    ckpt: str = field(compare=False)
    sp: bool = field(compare=False)
    zeros: tuple[int, ...] = field(compare=False)
    larger: tuple[int, ...] = field(compare=False)
    """The family's larger micro-batches (skipped when this one is already far over the memory budget)."""
    size: int = field(compare=False)


@dataclass
class LazyPool:
    """The search's candidates, made on demand in three steps, each in the order of its lower bound: a group
    (cheap bound, ``group_bound``) is *reached* — its options bounded exactly (``group_least``: the least
    candidate bound within the memory budget) and its micro-batch early stop applied — then *expanded* into
    candidates when that least bound comes up, and its candidates are predicted in the order of theirs."""

    spec: ModelSpec
    hw: Hardware
    pins: dict[str, Any]
    space: Space
    budget: float
    runtime: str
    cache: dict
    groups: list[Group]
    regions: dict
    pool: Pool = field(default_factory=Pool)
    heap: list[tuple[float, int, Candidate]] = field(default_factory=list)
    next_group: int = 0
    reached: list[tuple[float, int, Group]] = field(default_factory=list)
    """Reached groups not yet expanded, as a heap on their least candidate bound."""
    fitting: dict[int, int] = field(default_factory=dict)
    """Per reached group (by ``order``): its candidates within the memory budget."""
    seq: Any = field(default_factory=itertools.count)
    stopped: set = field(default_factory=set)
    """Families ``(tp, pp, dp, ckpt, sp)`` with the micro-batches above which nothing fits."""

    @staticmethod
    def build(spec: ModelSpec, hw: Hardware, *, devices: int, global_batch: int, pins: dict[str, Any],
              space: Space, budget: float, runtime: str, cache: dict) -> "LazyPool":
        regions: dict = {}
        hw_d = _hardware_for(hw, devices, cache)
        groups: list[Group] = []
        for tp, pp, dp in layouts(spec, hw, devices=devices, global_batch=global_batch, pins=pins, regions=regions):
            per = global_batch // dp
            for ckpt, sp, mbs, zeros in variants(spec, tp=tp, pp=pp, dp=dp, per=per, pins=pins, space=space):
                for i, mb in enumerate(mbs):
                    options = _schedule_options(pp, per, mb, space, pins, len(spec.layers))
                    if not options or not zeros:
                        continue
                    lb = group_bound(spec, hw_d, tp=tp, pp=pp, dp=dp, per=per, mb=mb, ckpt=ckpt, sp=sp, zeros=zeros,
                                     accum=min(a for _, _, a in options), precision=pins.get("precision", space.precision),
                                     runtime=runtime, cache=cache)
                    groups.append(Group(lb, len(groups), tp, pp, dp, per, mb, ckpt, sp, tuple(zeros),
                                        tuple(mbs[i + 1:]), len(options) * len(zeros)))
        groups.sort()
        return LazyPool(spec, hw_d, pins, space, budget, runtime, cache, groups, regions)

    @property
    def total(self) -> int:
        return sum(g.size for g in self.groups)

    def _bounds(self) -> tuple[float, float, float]:
        """The least bound of the next unreached group, reached group and candidate (inf: none left)."""
        g = self.groups[self.next_group].time_lb if self.next_group < len(self.groups) else math.inf
        return g, self.reached[0][0] if self.reached else math.inf, self.heap[0][0] if self.heap else math.inf

    def next_bound(self) -> float:
        """The least bound of anything not yet predicted (a group not expanded, or a candidate)."""
        return min(self._bounds())

    def pop(self) -> Candidate | None:
        """The candidate with the least bound, reaching and expanding groups whose bound is below it; None when
        empty. On a tie a group goes first (its candidates may tie the candidate)."""
        while True:
            g, r, c = self._bounds()
            if g < math.inf and g <= r and g <= c:
                self._reach(self.groups[self.next_group])
                self.next_group += 1
            elif r < math.inf and r <= c:
                self._expand(heapq.heappop(self.reached)[2])
            else:
                break
        if not self.heap:
            return None
        return heapq.heappop(self.heap)[2]

    def _reach(self, g: Group) -> None:
        family = (g.tp, g.pp, g.dp, g.ckpt, g.sp)
        if (family, g.mb) in self.stopped:
            return
        bound, least, fit = group_least(self.spec, self.hw, g, self.pins, self.space, self.budget, self.runtime,
                                        self.cache, self.regions)
        self.fitting[g.order] = fit
        if fit:
            heapq.heappush(self.reached, (bound, g.order, g))
        if least > _MB_STOP * self.budget and g.larger:
            # as the exhaustive enumeration: larger micro-batches of this family are over the budget too
            fresh = [mb for mb in g.larger if (family, mb) not in self.stopped]
            self.stopped.update((family, mb) for mb in fresh)
            if fresh:
                note_mb_stop(self.regions, tp=g.tp, pp=g.pp, dp=g.dp, ckpt=g.ckpt, mb=g.mb, skipped=fresh, least=least)

    def _expand(self, g: Group, pool: Pool | None = None) -> None:
        """``g``'s candidates into ``pool`` (default: the search's, onto the heap of those within the budget)."""
        into = pool if pool is not None else self.pool
        before = len(into.feasible)
        _expand_mb(self.spec, self.hw, into, self.regions, tp=g.tp, pp=g.pp, dp=g.dp, per=g.per, mb=g.mb,
                   ckpt=g.ckpt, sp=g.sp, zeros=list(g.zeros), pins=self.pins, space=self.space,
                   precision=self.pins.get("precision", self.space.precision), budget=self.budget,
                   runtime=self.runtime, cache=self.cache, note=False)
        if pool is None:
            for cand in into.feasible[before:]:
                heapq.heappush(self.heap, (cand.time_lb, next(self.seq), cand))

    def note_unexpanded(self, top: int, best_s: float) -> None:
        """Count what the bound ruled out without expanding it (``--explain``)."""
        rest = self.groups[self.next_group:]
        skipped = sum(g.size for g in rest if ((g.tp, g.pp, g.dp, g.ckpt, g.sp), g.mb) not in self.stopped)
        skipped += sum(self.fitting[g.order] for _, _, g in self.reached)
        if skipped:
            first = min([*rest[:1], *(g for _, _, g in self.reached)], key=lambda g: g.time_lb, default=None)
            example = (f"dp={first.dp} tp={first.tp} pp={first.pp} mb={first.mb}: every plan ≥ "
                       f"{first.time_lb * 1e3:.1f} ms vs {best_s * 1e3:.1f} ms (not expanded)") if first else ""
            _note(self.regions, f"bound: no faster than the best {top} plan{'s' * (top > 1)}", skipped, example)

    def everything(self) -> list[Candidate]:
        """Every candidate of every group not stopped, in group order (the infeasible report needs them)."""
        while self.next_group < len(self.groups):
            self._reach(self.groups[self.next_group])
            self.next_group += 1
        pool = Pool()
        for g in self.groups:
            if g.order in self.fitting:  # reached, not stopped
                self._expand(g, pool)
        return pool.feasible + pool.over_memory


def group_least(spec: ModelSpec, hw: Hardware, g: Group, pins: dict[str, Any], space: Space, budget: float,
                runtime: str, cache: dict, regions: dict) -> tuple[float, float, int]:
    """``(least time bound, least memory floor, count)`` of the group's candidates whose memory bound is within
    ``budget`` — the same numbers ``enumerate._bounds`` gives each candidate (``bounds`` module doc), without
    making them: one ``Plan`` per ZeRO stage and accumulation carries the fields the bounds read. The ones
    over the budget are counted in ``regions``."""
    precision = pins.get("precision", space.precision)
    base = Plan(dp=g.dp, tp=g.tp, pp=g.pp, micro_batch=g.mb, activation_checkpointing=g.ckpt,
                sequence_parallel=g.sp, precision=precision)
    per_layer = layer_costs(spec, base, hw, cache)
    plans: dict[tuple[int, int], Plan] = {}
    best = least = math.inf
    fit = 0
    for schedule, chunks, accum in _schedule_options(g.pp, g.per, g.mb, space, pins, len(spec.layers)):
        split = _split(spec, per_layer, g.pp * chunks, space, pins, cache, key=(g.tp, g.mb, g.ckpt, g.sp))
        opt = Option(schedule, chunks, split, g.per // g.mb // accum if g.pp > 1 else 1, split_id(split, cache))
        for zero in g.zeros:
            plan = plans.get((zero, accum))
            if plan is None:
                plan = plans[zero, accum] = replace(base, zero_stage=zero, grad_accum=accum)
            memory_lb, floor = memory_bounds(spec, plan, opt, hw, cache)
            least = min(least, floor)
            if memory_lb > budget:
                note_over_memory(regions, g.tp, g.pp, lambda: _candidate(plan, opt), memory_lb)
                continue
            fit += 1
            best = min(best, time_bound(spec, plan, opt, hw, per_layer, runtime, cache))
    return best, least, fit


def _candidate(plan: Plan, opt: Option) -> Plan:
    """The candidate ``Plan`` of a group's per-stage ``plan`` and a pipeline option (for region examples)."""
    return replace(plan, schedule=opt.schedule, chunks=opt.chunks, pp_split=opt.split,
                   microbatches=opt.m if plan.pp > 1 else 0)


def group_bound(spec: ModelSpec, hw: Hardware, *, tp: int, pp: int, dp: int, per: int, mb: int, ckpt: str, sp: bool,
                zeros: list[int], accum: int, precision: str, runtime: str, cache: dict) -> float:
    """The least ``time_lb`` any plan of the group can have (module doc)."""
    base = Plan(dp=dp, tp=tp, pp=pp, micro_batch=mb, activation_checkpointing=ckpt, sequence_parallel=sp,
                precision=precision)
    key = ("work", tp, mb, ckpt, sp, precision)
    if key not in cache:
        costs = layer_costs(spec, base, hw, cache)
        # cheapest[r]: the sum of the r cheapest layer forwards (r = 0 … layers); it does not depend on pp
        cheapest = list(itertools.accumulate(sorted(c.F for c in costs), initial=0.0))
        cache[key] = (sum(c.F + c.B + c.W for c in costs), cheapest)
    work, cheapest = cache[key]
    compute = per / mb * work / pp
    if not shares_cores(base, hw):
        # rank r starts after micro-batch 0's forward through the r stages before it (each at least one layer:
        # at least the r cheapest forwards); the slowest rank ends no earlier than the ranks' mean start + work
        compute += sum(cheapest[:pp]) / pp
    rest_key = ("rest", tp, pp, dp, tuple(zeros), accum, precision, runtime)  # all the rest depends on
    if rest_key not in cache:
        n_local = sum(local_params(layer, tp) for layer in spec.layers) / pp
        least_layers = math.ceil(len(spec.layers) / pp)
        fused = runtime == "megatron"
        rest = math.inf
        for z in zeros:
            plan = replace(base, zero_stage=z, grad_accum=accum)
            opt = _optimizer(plan, hw, n_local, least_layers * 12, fused=fused)
            comm = _dp_comm(plan, hw, n_local, math.inf, math.inf, runtime == "shardwise", least_layers)
            rest = min(rest, opt + comm)
        cache[rest_key] = rest
    return compute + cache[rest_key]
