"""``search(spec, hardware, devices=..., global_batch=...)``: every layout of a model on a device count, ranked
by predicted step time under a memory budget. Pure (no processes).

The space (``Space``): dp × tp × pp (× cp, × ep for a mixture of experts: one branch and bound per degree,
``cp_options`` / ``ep_options``) × ZeRO stage × micro-batch × schedule (gpipe, 1f1b, interleaved with v
chunks, zb-h1, zb-h2) × activation checkpointing × sequence parallelism, each pipeline cut into stages of
equal *predicted time* (``pp_split``), any field pinnable (``pins``). Constraints: dp × tp × pp = devices,
tp within a node (unless pinned), tp dividing the model's heads/widths, stages ≤ layers, the batch dividing.

Branch and bound, not blind enumeration (``enumerate.py`` lists the candidates, ``groups.py`` makes them on
demand): groups of candidates that share their layer costs are bounded first and expanded only while their
bound beats the K-th best plan so far; every candidate gets cheap lower bounds — memory of the first pipeline
rank with the activation sets its schedule holds there, time from the flush bound of
``pipeline_cost.flush_lower_bound`` — from layer costs memoised per (tp, micro-batch, recomputation, sp).
Candidates whose memory bound exceeds the budget are pruned; the rest are predicted in order of their time
bound, and the search stops once the next bound is slower than the K-th best plan found.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

from .enumerate import Region, Space, _note, normalize_pins
from .groups import LazyPool
from .hardware import Hardware
from .plan import Layout
from .predict import Prediction, predict
from .spec import ModelSpec
from .units import format_bytes

__all__ = ["search", "SearchResult", "Space", "NoFeasiblePlan"]


class NoFeasiblePlan(ValueError):
    """No layout fits; ``closest`` is the prediction that needs the least memory."""

    def __init__(self, message: str, closest: Prediction | None) -> None:
        super().__init__(message)
        self.closest = closest


@dataclass(frozen=True)
class SearchResult:
    """Ranked plans (fastest first, all fitting) with their predictions; iterates over the predictions."""

    predictions: list[Prediction]
    search_s: float
    candidates: int
    evaluated: int
    pruned: list[Region] = field(default_factory=list)
    budget_bytes: float = 0.0

    def __iter__(self) -> Iterator[Prediction]:
        return iter(self.predictions)

    def __len__(self) -> int:
        return len(self.predictions)

    def __getitem__(self, i: int) -> Prediction:
        return self.predictions[i]

    @property
    def best(self) -> Prediction:
        return self.predictions[0]

    def to_json(self) -> dict[str, Any]:
        return {"plans": [{"plan": p.plan.to_json(), "prediction": p.to_json()} for p in self.predictions],
                "search_s": self.search_s, "candidates": self.candidates, "evaluated": self.evaluated,
                "budget_bytes": self.budget_bytes,
                "pruned": [{"reason": r.reason, "count": r.count, "example": r.example,
                            **({"need_bytes": r.need_bytes} if r.need_bytes < float("inf") else {})}
                           for r in self.pruned]}


def search(spec: ModelSpec, hardware: Hardware, *, devices: int, global_batch: int,
           pins: Mapping[str, Any] | None = None, memory_margin: float = 0.1, top: int = 5,
           runtime: str = "shardwise", space: Space | None = None) -> SearchResult:
    """The ``top`` fastest plans of ``spec`` on ``devices`` devices of ``hardware`` that fit in
    ``(1 - memory_margin) × hardware.memory_bytes``, fastest first (see module doc).

    ``pins``: fixed fields, by ``Layout`` name (``{"tp": 8, "schedule": "1f1b"}``; the training config's names
    ``pp_schedule``, ``pp_chunks``, ``pp_microbatches`` are accepted too), and ``{"modules": {"wte":
    "replicate"}}`` to keep a module whole on every tensor-parallel rank (data-parallel only). ``space``:
    what may vary (default: what ``runtime`` runs — ``Space.runnable()`` for ``shardwise``, ``Space()`` for
    ``megatron``). Bad input raises ``ValueError`` with the values and the fix; when no layout fits,
    ``NoFeasiblePlan`` (a ``ValueError``) names the least memory needed and its plan (``.closest``)."""
    start = time.perf_counter()
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ValueError(f"devices = {devices!r}: the search needs at least one device; e.g. devices=8")
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch = {global_batch!r} must be a positive number of sequences; e.g. 512")
    if not 0 <= memory_margin < 1:
        raise ValueError(f"memory_margin = {memory_margin!r} is the fraction of device memory kept free; it must be "
                         f"in [0, 1), e.g. 0.1")
    if top < 1:
        raise ValueError(f"top = {top!r} must be >= 1")
    if runtime not in ("shardwise", "megatron"):
        raise ValueError(f"runtime must be 'shardwise' or 'megatron', got {runtime!r}")
    fixed, modules = normalize_pins(pins or {})
    if modules:
        spec = spec.replicate(sorted(modules))
    space = space or (Space.runnable() if runtime == "shardwise" else Space())
    budget = hardware.memory_bytes * (1 - memory_margin)
    best: list[Prediction] = []
    evaluated = total = 0
    pools = []
    regions: dict[str, Region] = {}
    with _collection_paused():
        # one branch and bound per context-parallel degree (cp = 1 first), each on the cp rank's view of the
        # model and seeded with the best plans so far: a cp whose every bound is slower stops at once
        for cp in cp_options(spec, devices, fixed, space):
            if cp > 1 and "cp" not in fixed and best and _attention_share(spec) < space.cp_attention_share:
                continue  # a short sequence for the model, and cp = 1 fits: not searched (Space.cp_attention_share)
            local = spec.for_cp(cp)
            pins_cp = {**fixed, "cp": cp} if cp > 1 or "cp" in fixed else fixed
            # and one per expert-parallel degree (ep = 1 first; each with its own cache: costs depend on ep)
            for ep in ep_options(spec, devices, cp, fixed):
                pins_ep = {**pins_cp, "ep": ep} if ep > 1 or "ep" in fixed else pins_cp
                cache: dict = {}
                lazy = LazyPool.build(local, hardware, devices=devices, global_batch=global_batch, pins=pins_ep,
                                      space=space, budget=budget, runtime=runtime, cache=cache)
                best, n = _branch_and_bound(local, hardware, lazy, global_batch, budget, top, runtime, cache, best)
                evaluated += n
                pools.append((local, lazy, cache))
                for r in lazy.regions.values():
                    _note(regions, r.reason, r.count, r.example, r.need_bytes)
                total += lazy.total
    if not best:
        _raise_infeasible(hardware, pools, global_batch, budget, runtime, devices)
    total += sum(r.count for r in regions.values() if r.reason.startswith("invalid"))
    return SearchResult(predictions=best, search_s=time.perf_counter() - start, candidates=total,
                        evaluated=evaluated, pruned=sorted(regions.values(), key=lambda r: -r.count),
                        budget_bytes=budget)


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while the search runs, as it was after. The search makes some 10^5
    short-lived tuples and lists (freed by reference counting: it makes no cycles), and their count alone
    triggers collections; with torch imported a full one walks every object of the process, which at 1,024
    devices cost a fifth of the search's CPU time for nothing to collect."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _attention_share(spec: ModelSpec) -> float:
    """The attention cores' share of the model's forward FLOPs (counted in full)."""
    total = sum(layer.flops for layer in spec.layers)
    attn = sum(g.flops for layer in spec.layers for g in layer.gemms if not g.weight)
    return attn / total if total else 0.0


def cp_options(spec: ModelSpec, devices: int, fixed: Mapping[str, Any], space: Space) -> list[int]:
    """The context-parallel degrees to search: the pinned one, else ``space.context_parallel`` where ``2·cp``
    divides the sequence, cp divides the devices and the model has an attention core to split over a ring;
    ``ValueError`` for a pin that cannot be."""
    attention = any(not g.weight for layer in spec.layers for g in layer.gemms)
    if "cp" in fixed:
        cp = fixed["cp"]
        if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1 or devices % cp:
            raise ValueError(f"pin cp = {cp!r} must be a positive divisor of the {devices} devices")
        if cp > 1 and spec.seq_len % (2 * cp):
            raise ValueError(f"pin cp = {cp} needs the sequence length divisible by 2·cp = {2 * cp}, got "
                             f"{spec.seq_len}; pin a cp whose 2·cp divides it")
        if cp > 1 and not attention:
            raise ValueError(f"pin cp = {cp}: model {spec.name!r} has no attention core to split over a ring; pin cp 1")
        return [cp]
    pinned = 1
    for axis in ("dp", "tp", "pp"):
        pinned *= fixed.get(axis, 1)
    full = all(axis in fixed for axis in ("dp", "tp", "pp"))
    return [cp for cp in sorted(set(space.context_parallel) | {1})
            if cp == 1 or (attention and devices % (cp * pinned) == 0 and spec.seq_len % (2 * cp) == 0
                           and (not full or cp * pinned == devices))]


def ep_options(spec: ModelSpec, devices: int, cp: int, fixed: Mapping[str, Any]) -> list[int]:
    """The expert-parallel degrees to search at ``cp``: the pinned one, else every divisor of the model's expert
    count that divides the ``devices / cp`` ranks (``layouts`` keeps the ``dp`` each divides); ``[1]`` for a dense
    model. ``ValueError`` for a pin that cannot be."""
    experts = spec.n_experts
    if "ep" in fixed:
        ep = fixed["ep"]
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1 or devices % ep:
            raise ValueError(f"pin ep = {ep!r} must be a positive divisor of the {devices} devices")
        if ep > 1 and (not experts or experts % ep):
            raise ValueError(f"pin ep = {ep} must divide the model's routed experts ({experts}); pin an ep among "
                             f"{[d for d in range(1, experts + 1) if experts % d == 0] or [1]}")
        return [ep]
    return [ep for ep in range(1, experts + 1) if experts % ep == 0 and (devices // cp) % ep == 0] or [1]


def _branch_and_bound(spec: ModelSpec, hw: Hardware, lazy: LazyPool, global_batch: int, budget: float, top: int,
                      runtime: str, cache: dict,
                      seed: list[Prediction] | None = None) -> tuple[list[Prediction], int]:
    """Predict candidates in bound order until the ``top``-th best (``seed``: the best of earlier pools) beats
    every bound left."""
    best: list[Prediction] = list(seed or [])
    evaluated = 0
    regions = lazy.regions
    while True:
        if len(best) >= top and lazy.next_bound() >= _rank_key(best[-1]):
            rest = len(lazy.heap)
            if rest:
                cand = lazy.heap[0][2]
                _note(regions, f"bound: no faster than the best {top} plan{'s' * (top > 1)}", rest,
                      f"{cand.plan.describe()}: ≥ {cand.time_lb * 1e3:.1f} ms vs {best[-1].step_time_s * 1e3:.1f} ms")
            lazy.note_unexpanded(top, best[-1].step_time_s)
            break
        cand = lazy.pop()
        if cand is None:
            break
        pred = predict(spec, cand.plan, hw, global_batch=global_batch, runtime=runtime, cache=cache)
        evaluated += 1
        if pred.memory.total > budget:
            _note(regions, f"memory: predicted peak over the budget (tp={cand.plan.tp} pp={cand.plan.pp})", 1,
                  f"{cand.plan.describe()}: {format_bytes(pred.memory.total, 2)} > {format_bytes(budget, 2)} "
                  f"(largest: {pred.memory.largest})", need=pred.memory.total)
            continue
        best.append(pred)
        best.sort(key=_rank_key)
        del best[top:]
    return best, evaluated


def simplicity(plan: Layout) -> float:
    """How much machinery a plan uses (pipeline, ZeRO stage, recomputation, zero-bubble or interleaved
    schedules, tensor and expert parallelism): among plans predicted within the tie tolerance, the simpler one
    ranks first."""
    schedule = {"1f1b": 0.0, "gpipe": 0.0, "zb-h1": 0.5, "zb-h2": 1.0, "interleaved": 1.0}[plan.schedule]
    return ((plan.pp > 1) + 0.25 * plan.zero_stage + (plan.activation_checkpointing != "none")
            + (schedule if plan.pp > 1 else 0.0) + 0.5 * (plan.tp > 1) + 0.5 * plan.sequence_parallel
            + 0.25 * (plan.ep > 1))


TIE = 0.002
"""Predictions closer than this fraction are a tie (below the model's resolution); the simpler plan wins."""


def _rank_key(pred: Prediction) -> float:
    return pred.step_time_s * (1 + TIE * simplicity(pred.plan))


def _raise_infeasible(hw: Hardware, pools: list[tuple[ModelSpec, LazyPool, dict]], global_batch: int, budget: float,
                      runtime: str, devices: int) -> None:
    spec = pools[0][0]
    # the closest plan: smallest predicted peak among the candidates with the smallest memory bounds (of any cp)
    preds = []
    for local, lazy, cache in pools:
        everything = lazy.everything()
        preds += [predict(local, c.plan, hw, global_batch=global_batch, runtime=runtime, cache=cache)
                  for c in sorted(everything, key=lambda c: c.memory_floor)[:16]]
    if not preds:
        regions: dict[str, Region] = {}
        for _, lazy, _ in pools:
            for r in lazy.regions.values():
                _note(regions, r.reason, r.count, r.example, r.need_bytes)
        reasons = "; ".join(f"{r.reason} ({r.count}, e.g. {r.example})" for r in regions.values())
        raise ValueError(f"no layout of model {spec.name!r} on {devices} devices is valid: {reasons}; change the "
                         f"pins, the device count or the global batch")
    closest = min(preds, key=lambda p: p.memory.total)
    mem = closest.memory
    raise NoFeasiblePlan(
        f"model {spec.name!r} fits no layout on {devices} devices of {format_bytes(hw.memory_bytes)} (budget "
        f"{format_bytes(budget)} after the margin): the closest, {closest.plan.describe()}, needs "
        f"{format_bytes(mem.total, 2)} per device (largest: {mem.largest}, {format_bytes(getattr(mem, mem.largest), 2)}); "
        f"{_remedies(closest.plan, mem.largest)}", closest)


def _remedies(plan: Layout, largest: str = "") -> str:
    """What could make the closest plan fit, leaving out what it already does."""
    out = ["add devices"]
    if plan.precision == "fp32":
        out.append("use precision bf16-mixed")
    if plan.zero_stage < 3:
        out.append("allow a higher zero_stage (unpin it, or pin 3)" if plan.dp > 1 else
                   "allow data parallelism so that ZeRO can shard the states (fewer tp/pp)")
    if plan.activation_checkpointing != "full":
        out.append("allow full activation checkpointing")
    if largest == "activations":
        out.append("allow (a larger) context parallelism cp, which splits each sequence's activations")
    out.append("or use a device with more memory")
    return ", ".join(out)
