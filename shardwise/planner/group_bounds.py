"""Bounds of a whole group of candidates (``groups.LazyPool`` orders groups by them).

A **group** is every plan of one ``(tp, pp, dp, recomputation, sequence parallelism, micro-batch)``: they share
their layer costs and differ in ZeRO stage, schedule, chunks and gradient accumulation. Two bounds, each at
most the bound of every candidate in the group (tested):

* ``group_bound`` needs no stage split and no schedule: a step runs ``per / mb`` micro-batches through the
  whole model, spread over ``pp`` ranks at best evenly, so no pipeline rank computes less than
  ``per / mb × (F + B + W of the model) / pp``; the optimizer and the exposed data-parallel communication, both
  increasing in the parameters a rank holds, are at least those of ``1/pp`` of the model's parameters (the
  least over the group's ZeRO stages). A pipeline adds its fill: rank ``r`` starts after micro-batch 0's
  forward through the ``r`` stages before it (at least the ``r`` cheapest layers), and the slowest rank ends
  no earlier than the ranks' mean start plus their mean work (not on a CPU host whose ranks share cores: there
  the flush bound is the mean work alone).
* ``group_least``: the least candidate time bound among those whose memory bound fits (``bounds`` per
  schedule option and ZeRO stage, on the stage splits; memory first, the time only of what fits), with the
  least memory floor (for the micro-batch early stop) and how many fit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from .bounds import Option, memory_bounds, split_id, time_bound
from .enumerate import Space, _schedule_options, _split, async_tp_of, note_over_memory
from .hardware import Hardware
from .memory import frozen_local, local_params
from .plan import Layout
from .step_extras import fused_optimizer, optimizer_time
from .predict import _dp_comm, layer_costs, shares_cores
from .spec import ModelSpec

__all__ = ["Group", "group_bound", "group_least"]


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


def group_bound(spec: ModelSpec, hw: Hardware, *, tp: int, pp: int, dp: int, per: int, mb: int, ckpt: str, sp: bool,
                zeros: list[int], accum: int, precision: str, runtime: str, cache: dict, cp: int = 1,
                async_tp: bool = False, ep: int = 1) -> float:
    """The least ``time_lb`` any plan of the group can have (module doc)."""
    base = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=mb, activation_checkpointing=ckpt,
                  sequence_parallel=sp, async_tp=async_tp, precision=precision)
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
        # frozen elements are neither reduced nor stepped (left out: still a lower bound)
        n_local = (sum(local_params(layer, tp, ep) for layer in spec.layers) - frozen_local(spec.layers, tp, ep)) / pp
        least_layers = math.ceil(len(spec.layers) / pp)
        fused = fused_optimizer(runtime, hw)
        rest = math.inf
        for z in zeros:
            plan = replace(base, zero_stage=z, grad_accum=accum)
            # n_local: at most what optimizer_elements gives any rank (its experts count ep times under ZeRO)
            opt = optimizer_time(plan, hw, n_local, least_layers * 12, fused=fused, multi_tensor=runtime == "shardwise")
            comm = _dp_comm(plan, hw, n_local, math.inf, math.inf, runtime == "shardwise", least_layers)
            if ep > 1:  # a rank's split into dense and expert parameters is unknown here: the cheaper pricing of all
                comm = min(comm, _dp_comm(plan, hw, n_local, math.inf, math.inf, runtime == "shardwise", least_layers,
                                          expert=True))
            rest = min(rest, opt + comm)
        cache[rest_key] = rest
    return compute + cache[rest_key]


def _options(spec: ModelSpec, hw: Hardware, g: Group, pins: dict[str, Any], space: Space,
             cache: dict) -> Iterator[tuple[Option, int, list[Any]]]:
    """The group's pipeline options: ``(option, accumulation, layer costs)``."""
    precision = pins.get("precision", space.precision)
    base = Layout(dp=g.dp, tp=g.tp, pp=g.pp, cp=pins.get("cp", 1), ep=pins.get("ep", 1), micro_batch=g.mb,
                  activation_checkpointing=g.ckpt, sequence_parallel=g.sp, async_tp=async_tp_of(pins, g.tp),
                  precision=precision)
    per_layer = layer_costs(spec, base, hw, cache)
    for schedule, chunks, accum in _schedule_options(g.pp, g.per, g.mb, space, pins, len(spec.layers), g.ckpt):
        key = ("split and id", g.tp, g.mb, g.ckpt, g.sp, g.pp * chunks)
        if key not in cache:
            split = _split(spec, per_layer, g.pp * chunks, space, pins, cache, key=(g.tp, g.mb, g.ckpt, g.sp))
            cache[key] = (split, split_id(split, cache))
        split, sid = cache[key]
        yield Option(schedule, chunks, split, g.per // g.mb // accum if g.pp > 1 else 1, sid), accum, per_layer


def _plans(g: Group, accum: int, precision: str, made: dict[int, list[Layout]], cp: int = 1,
           async_tp: bool = False, ep: int = 1) -> list[Layout]:
    """One ``Layout`` per ZeRO stage of the group with ``accum`` flushes: the fields the bounds read besides the
    pipeline option (``bounds`` module doc); memoised in ``made`` per accumulation."""
    if accum not in made:
        made[accum] = [Layout(dp=g.dp, tp=g.tp, pp=g.pp, cp=cp, ep=ep, zero_stage=zero, micro_batch=g.mb,
                              grad_accum=accum, activation_checkpointing=g.ckpt, sequence_parallel=g.sp,
                              async_tp=async_tp, precision=precision)
                       for zero in g.zeros]
    return made[accum]


def group_least(spec: ModelSpec, hw: Hardware, g: Group, pins: dict[str, Any], space: Space, budget: float,
                runtime: str, cache: dict, regions: dict) -> tuple[float, float, int]:
    """``(least time bound, least memory floor, count)`` of the group's candidates whose memory bound is within
    ``budget`` — the same numbers ``enumerate._bounds`` gives each candidate, without making them. The ones
    over the budget are counted in ``regions``."""
    best = least = math.inf
    fit = 0
    precision = pins.get("precision", space.precision)
    made: dict[int, list[Layout]] = {}
    cp, ep = pins.get("cp", 1), pins.get("ep", 1)
    async_tp = async_tp_of(pins, g.tp)
    over, need, example = 0, math.inf, None  # the ones over the budget, noted once (the least need first)
    for opt, accum, per_layer in _options(spec, hw, g, pins, space, cache):
        # memory reads the accumulation: gradients released in backward overlap the activations only without it
        carriers = _plans(g, accum, precision, made, cp, async_tp, ep)
        for i, (memory_lb, floor) in enumerate(memory_bounds(spec, carriers, opt, hw, cache)):
            least = min(least, floor)
            if memory_lb > budget:
                over += 1
                if memory_lb < need or example is None:
                    need, example = min(need, memory_lb), (accum, i, opt, memory_lb)
                continue
            fit += 1
            plan = _plans(g, accum, precision, made, cp, async_tp, ep)[i]
            best = min(best, time_bound(spec, plan, opt, hw, per_layer, runtime, cache))
    if example is not None:
        accum, i, opt, memory_lb = example
        note_over_memory(regions, g.tp, g.pp,
                         lambda: _candidate(_plans(g, accum, precision, made, cp, async_tp, ep)[i], opt),
                         memory_lb, count=over)
    return best, least, fit


def _candidate(plan: Layout, opt: Option) -> Layout:
    """The candidate ``Layout`` of a group's per-stage ``plan`` and a pipeline option (for region examples)."""
    return replace(plan, schedule=opt.schedule, chunks=opt.chunks, pp_split=opt.split,
                   microbatches=opt.m if plan.pp > 1 else 0)
