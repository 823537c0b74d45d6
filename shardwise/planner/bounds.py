"""Lower bounds of one candidate's step time and memory, without a pipeline simulation.

A candidate is a ``Layout``; its bounds depend on two parts of it: the pipeline option ``Option`` (schedule,
chunks, stage split, micro-batches per flush) and everything else (dp, tp, pp, ZeRO stage, micro-batch,
gradient accumulation, recomputation, sequence parallelism, precision), which any ``Layout`` carrying those
fields supplies — the candidate's own, or one per ZeRO stage of a whole group (``groups.LazyPool`` bounds a
group's options that way before it makes a ``Layout`` per candidate). Both routes run the same arithmetic, so
a group's least bound is bit for bit its best candidate's. Everything is memoised in the search's ``cache``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

from .hardware import Hardware
from .memory import frozen_local, local_params, rank_memory, rank_parts, runtime_bytes, stage_activation_bytes
from .moe import expert_local, optimizer_elements
from .pipeline_cost import (bound_of_terms, first_forwards, first_rank_in_flight, flush_lower_bound, flush_terms,
                            split_at, split_stages)
from .plan import Layout
from .step_extras import fused_optimizer, optimizer_time
from .dp_comm import dp_comm
from .predict import _bucket_cap, fold_transfers, shares_cores, stage_sums
from .spec import ModelSpec

__all__ = ["Option", "split_id", "option_of", "shape_of", "time_bound", "flush_bound", "rest_bounds", "memory_bounds"]


class Option(NamedTuple):
    """The pipeline part of a candidate: schedule, model chunks per rank, stage starts (layer names, ``()``:
    by parameters), micro-batches per flush (1 without a pipeline), and the split's number in the search's cache
    (``split_id``: memo keys hold it instead of the split, whose hash costs a pass over up to hundreds of names)."""

    schedule: str
    chunks: int
    split: tuple[str, ...]
    m: int
    sid: int


def split_id(split: tuple[str, ...], cache: dict) -> int:
    """A number per distinct split (the same for equal splits) within one search's ``cache``."""
    ids = cache.setdefault(("split ids",), {})
    return ids.setdefault(split, len(ids))


def option_of(plan: Layout, cache: dict) -> Option:
    return Option(plan.schedule, plan.chunks, plan.pp_split, plan.microbatches if plan.pp > 1 else 1,
                  split_id(plan.pp_split, cache))


def shape_of(spec: ModelSpec, tp: int, pp: int, opt: Option, cache: dict, ep: int = 1) -> tuple:
    """Stages, their first layer indices, each pipeline rank's stages and layers, and the largest rank's local
    parameters and tensor count (memoised per tp, pp, chunks, split, ep; its routed-expert parameters under
    ``("experts",) + key``)."""
    key = ("shape", tp, pp, opt.chunks, opt.sid) + ((ep,) if ep > 1 else ())
    if key not in cache:
        # ``predict.stages_of``: cut at the split, else balanced by parameters
        stages = split_at(spec.layers, opt.split) if opt.split else split_stages(spec.layers, pp * opt.chunks)
        starts = [sum(len(st) for st in stages[:i]) for i in range(len(stages))]
        ranks = [[s for s in range(len(stages)) if s % pp == r] for r in range(pp)]
        rank_layers = [[layer for s in ranks[r] for layer in stages[s]] for r in range(pp)]
        # ``predict``'s: the largest rank's local parameters and its routed experts' (the search's cache is per ep)
        n_local, n_expert = max((sum(local_params(layer, tp, ep) for layer in rl),
                                 sum(expert_local(layer, tp, ep) for layer in rl)) for rl in rank_layers)
        # frozen elements are neither reduced nor stepped: a bound prices only the trainable ones (ZeRO-3's
        # gathers of frozen weights left out keeps it a lower bound)
        if any(layer.frozen for layer in spec.layers):
            n_local = min(sum(local_params(layer, tp, ep) for layer in rl) - frozen_local(rl, tp, ep)
                          for rl in rank_layers)
        tensors = max(len(rl) for rl in rank_layers) * 12
        cache[key] = (stages, starts, ranks, rank_layers, n_local, tensors)
        cache[("experts",) + key] = n_expert
    return cache[key]


def time_bound(spec: ModelSpec, plan: Layout, opt: Option, hw: Hardware, per_layer: list[Any], runtime: str,
               cache: dict) -> float:
    """Flushes × the flush bound + the optimizer + the least exposed data-parallel communication (``plan``
    supplies everything but the pipeline option, see module doc)."""
    optimizer, dp = rest_bounds(spec, plan, opt, hw, runtime, cache)
    return plan.grad_accum * flush_bound(spec, plan, opt, hw, per_layer, runtime, cache) + optimizer + dp


def flush_bound(spec: ModelSpec, plan: Layout, opt: Option, hw: Hardware, per_layer: list[Any], runtime: str,
                cache: dict) -> float:
    """One flush's lower bound (``pipeline_cost.flush_lower_bound``; the mean busy time where pipeline ranks
    share a host's cores); it does not depend on the ZeRO stage or the accumulation."""
    sums_key = ("sums", id(per_layer), plan.pp, opt.chunks, opt.sid)
    flush_key = ("flush_lb", sums_key, plan.dp * plan.cp, opt.schedule, opt.m)
    if flush_key not in cache:
        stages, starts, *_ = shape_of(spec, plan.tp, plan.pp, opt, cache, plan.ep)
        if sums_key not in cache:
            cache[sums_key] = stage_sums([per_layer[a:a + len(st)] for a, st in zip(starts, stages)])
        fold_key = ("fold", sums_key, plan.dp * plan.cp)
        if fold_key not in cache:
            F, B, W, comm = fold_transfers(plan, *cache[sums_key], stages, hw, blocking=runtime == "megatron")
            # the flush bound's terms serve every schedule and micro-batch count on this split (one pass)
            terms = flush_terms(plan.pp, opt.chunks, F, B, W, comm) if plan.pp > 1 else None
            cache[fold_key] = (F, B, W, comm, terms)
        F, B, W, comm, terms = cache[fold_key]
        m = opt.m
        if shares_cores(plan, hw):
            cache[flush_key] = m * sum(F[s] + B[s] + W[s] for s in range(len(F))) / plan.pp  # mean busy
        elif terms is None:
            cache[flush_key] = flush_lower_bound(opt.schedule, plan.pp, m, opt.chunks, F, B, W, comm)
        else:
            cache[flush_key] = bound_of_terms(opt.schedule, m, terms)  # = flush_lower_bound, bit for bit
    return cache[flush_key]


def rest_bounds(spec: ModelSpec, plan: Layout, opt: Option, hw: Hardware, runtime: str,
                cache: dict) -> tuple[float, float]:
    """``(optimizer seconds, least exposed data-parallel seconds)`` of a step: what the largest pipeline rank's
    parameters cost besides the flushes."""
    _, _, _, rank_layers, n_local, tensors = shape_of(spec, plan.tp, plan.pp, opt, cache, plan.ep)
    n_expert = cache[("experts", "shape", plan.tp, plan.pp, opt.chunks, opt.sid) + ((plan.ep,) if plan.ep > 1 else ())]
    fused = fused_optimizer(runtime, hw)
    opt_key = ("optimizer", n_local, tensors, plan.zero_group, plan.zero_stage, fused, plan.ep, n_expert)
    if opt_key not in cache:
        cache[opt_key] = optimizer_time(plan, hw, optimizer_elements(plan, n_local, n_expert), tensors, fused=fused,
                                        multi_tensor=runtime == "shardwise")
    # the data-parallel / ZeRO communication a step exposes at the least: with unbounded compute to hide under
    # (``_dp_comm`` only decreases as forward and backward grow)
    dp_key = ("dp_lb", n_local, plan.zero_group, plan.tp, plan.zero_stage, plan.grad_accum, plan.precision,
              len(rank_layers[0]), plan.ep, n_expert)
    if dp_key not in cache:
        units = max(len(rl) for rl in rank_layers)
        cache[dp_key] = dp_comm(plan, hw, n_local, math.inf, math.inf, runtime == "shardwise", units, n_expert)
    return cache[opt_key], cache[dp_key]


def memory_bounds(spec: ModelSpec, plans: Sequence[Layout], opt: Option, hw: Hardware,
                  cache: dict) -> list[tuple[float, float]]:
    """``(memory_lb, memory_floor)`` (see ``enumerate.Candidate``) per plan of ``plans`` (plans that differ
    only in ZeRO stage or accumulation, under one pipeline option): pipeline rank 0's memory with the activation
    sets its schedule holds at the peak (``first_rank_in_flight``, what ``predict`` counts there) and with the
    fewest any schedule holds (``min(m, p)``, gpipe ``m × chunks``)."""
    plan = plans[0]
    stages, _, ranks, rank_layers, _, _ = shape_of(spec, plan.tp, plan.pp, opt, cache, plan.ep)
    m, pp = opt.m, plan.pp
    fewest = 1 if pp == 1 else m * opt.chunks if opt.schedule == "gpipe" else min(m * opt.chunks, pp)
    held = first_rank_in_flight(opt.schedule, pp, m, opt.chunks)
    # by chunk: rank 0's first forwards in the schedule's order (what it holds before its first backward, a moment
    # ``predict``'s by-chunk peak, ``held_bytes``, is never below); gpipe holds every forward
    counts = {sets: ((m,) * opt.chunks if opt.schedule == "gpipe" and pp > 1 else
                     first_forwards(pp, opt.chunks, sets)) for sets in (held, fewest)}
    parts_key = ("mem_parts", plan.tp, pp, opt.chunks, opt.sid, plan.micro_batch, plan.activation_checkpointing,
                 plan.sequence_parallel, plan.precision, plan.ep)
    memo = cache.get(parts_key)
    if memo is None:  # rank 0's parts and its chunks' bytes, and its totals by (ZeRO stage, dp, sets held)
        chunks0 = [stages[s] for s in ranks[0]]
        memo = cache[parts_key] = (rank_parts(rank_layers[0], chunks0, plan), stage_activation_bytes(chunks0, plan),
                                   {})
    parts, chunk_bytes, totals = memo
    out = []
    for plan in plans:
        pair = []
        for sets in (held, fewest):
            key = (plan.zero_stage, plan.zero_group, sets, plan.grad_accum, plan.optimizer)
            total = totals.get(key)
            if total is None:
                bytes_held = sum(c * b for c, b in zip(counts[sets], chunk_bytes)) if pp > 1 else None
                total = totals[key] = rank_memory(rank_layers[0], [stages[s] for s in ranks[0]], sets, plan,
                                                  hw.memory_bytes, bucket_cap=_bucket_cap(plan), parts=parts,
                                                  runtime=runtime_bytes(hw.kind), held=bytes_held).total
            pair.append(total)
        out.append((pair[0], pair[1]))
    return out
