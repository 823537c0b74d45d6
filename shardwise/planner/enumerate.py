"""The search space as plain data (``Space``), pins, and the candidates with their lower bounds.

A candidate is a ``Layout`` plus two bounds that need no pipeline simulation: ``memory_lb`` (the first
pipeline rank with the activation sets its schedule holds there at the peak, ``first_rank_in_flight``: for an
interleaved schedule many more than ``p``, which prunes those plans before they are simulated) and ``time_lb``
(``pipeline_cost.flush_lower_bound`` × flushes + the optimizer), both computed in ``bounds``. Both come from
the same layer costs ``predict`` uses (memoised in the search's cache), so ``time_lb ≤
predict(...).step_time_s`` and ``memory_lb ≤ predict(...).memory.total`` hold by construction (tested).
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Mapping

from .bounds import memory_bounds, option_of, time_bound
from .hardware import Hardware
from .pipeline_cost import balance_minmax
from .plan import CHECKPOINTING, SCHEDULES, Layout
from .predict import _hardware_for, layer_costs
from .spec import ModelSpec
from .units import format_bytes

__all__ = ["Space", "Region", "Candidate", "Pool", "normalize_pins", "candidates", "divisors", "layouts", "variants",
           "async_tp_of"]

_ALIASES = {"pp_schedule": "schedule", "pp_chunks": "chunks", "pp_microbatches": "microbatches",
            "precision": "precision"}
_PLAN_FIELDS = {f.name for f in fields(Layout)}


@dataclass(frozen=True)
class Space:
    """What the search may vary (pins narrow it further)."""

    schedules: tuple[str, ...] = SCHEDULES
    chunks: tuple[int, ...] = (2, 3, 4, 6, 8)
    """Model chunks per pipeline rank the interleaved schedule may use."""
    zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    pipeline_zero_stages: tuple[int, ...] = (0, 1, 2, 3)
    """ZeRO stages a pipeline combines with (all; stage 3 gathers every unit for each micro-batch's forward and
    backward, which ``dp_comm`` prices)."""
    checkpointing: tuple[str, ...] = CHECKPOINTING
    sequence_parallel: tuple[bool, ...] = (False, True)
    max_micro_batch: int = 16
    precision: str = "fp32"
    """The precision when not pinned (a numerical choice the user makes, not the search)."""
    context_parallel: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    """Context-parallel degrees (``Layout.cp``) the search may use, where the device count is a multiple of cp
    and ``2·cp`` divides the sequence length (``search`` runs one branch and bound per cp, cp = 1 first)."""
    cp_attention_share: float = 0.1
    """cp > 1 is searched where the attention core is at least this share of the model's forward FLOPs (a
    sequence long for the model's width), or where no cp = 1 layout fits; 0: always. Elsewhere a cp rank runs
    the same tokens per device as data parallelism in smaller attention blocks, and searching it would triple
    the search time."""
    time_balanced_split: bool = True
    """Cut pipelines into stages of equal predicted time (``Layout.pp_split``), not equal parameters."""

    @staticmethod
    def runnable() -> "Space":
        """What ``shardwise train`` runs: recomputation none, full or selective, no sequence parallelism; context
        parallelism where it pays (``cp_attention_share``), as ``Space()`` searches it."""
        return Space(checkpointing=("none", "full", "selective"), sequence_parallel=(False,))


@dataclass
class Region:
    """Candidates pruned for one reason in one (tp, pp) region."""

    reason: str
    count: int = 0
    example: str = ""
    need_bytes: float = float("inf")
    """Memory regions: the least memory any of their candidates needs (a lower bound)."""


def _note(regions: dict[str, Region], reason: str, count: int, example: str | Callable[[], str],
          need: float = float("inf")) -> None:
    """Count ``count`` candidates under ``reason``; ``example`` (or a function making it, called only when the
    example is kept) names the one needing the least memory."""
    region = regions.setdefault(reason, Region(reason=reason))
    region.count += count
    if need < region.need_bytes or not region.example:
        region.example = example() if callable(example) else example
        region.need_bytes = min(region.need_bytes, need)


@dataclass(frozen=True)
class Candidate:
    plan: Layout
    time_lb: float
    memory_lb: float
    """Pipeline rank 0's memory with the activation sets its schedule holds there at the peak."""
    memory_floor: float = 0.0
    """Rank 0's memory with the fewest activation sets any schedule holds (``min(m, p)``, gpipe ``m × chunks``):
    the micro-batch early stop and the closest-plan report rank by it (they did before ``memory_lb`` counted
    the schedule's own peak, and their results stay as they were)."""


@dataclass
class Pool:
    feasible: list[Candidate] = field(default_factory=list)
    """Memory bound within the budget: predicted in order of ``time_lb``."""
    over_memory: list[Candidate] = field(default_factory=list)
    total: int = 0


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def normalize_pins(pins: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``(plan fields, module pins)``; ``ValueError`` for an unknown field or a bad module strategy."""
    fixed: dict[str, Any] = {}
    modules: dict[str, str] = {}
    for key, value in pins.items():
        if key == "modules":
            for name, strategy in dict(value).items():
                if strategy not in ("replicate", "data-parallel"):
                    raise ValueError(f"module pin {name!r}: {strategy!r} is not a strategy the planner knows; use "
                                     f"'replicate' (kept whole on every tensor-parallel rank, data-parallel only)")
                modules[name] = "replicate"
            continue
        name = key.split(".", 1)[1] if key.startswith(("parallel.", "train.")) else key
        name = _ALIASES.get(name, name)
        if name not in _PLAN_FIELDS:
            raise ValueError(f"pin {key!r} is not a plan field; pinnable: {sorted(_PLAN_FIELDS)} and 'modules'")
        if name == "activation_checkpointing" and isinstance(value, bool):
            value = "full" if value else "none"
        if name == "pp_split":
            value = tuple(value)
        fixed[name] = value
    return fixed, modules


def pipeline_pins(fixed: Mapping[str, Any]) -> list[str]:
    """The pins that only a pipeline can honour: a schedule other than the default ``1f1b`` (which a single
    stage runs as plain forward/backward), several chunks, a micro-batch count per flush, stage cuts."""
    out = []
    if fixed.get("schedule", "1f1b") != "1f1b":
        out.append(f"schedule {fixed['schedule']!r}")
    if fixed.get("chunks", 1) > 1:
        out.append(f"chunks {fixed['chunks']}")
    if fixed.get("microbatches", 0):
        out.append(f"microbatches {fixed['microbatches']}")
    if fixed.get("pp_split"):
        out.append(f"pp_split {list(fixed['pp_split'])}")
    return out


def _check_pins(fixed: dict[str, Any], devices: int) -> None:
    axes = {k: fixed[k] for k in ("dp", "cp", "tp", "pp") if k in fixed}
    for k, v in axes.items():
        if not isinstance(v, int) or v < 1 or devices % v:
            raise ValueError(f"pin {k} = {v!r} must be a positive divisor of the {devices} devices; use one of "
                             f"{divisors(devices)}")
    product = 1
    for v in axes.values():
        product *= v
    if devices % product or (len(axes) == 4 and product != devices):
        raise ValueError(f"pins {' × '.join(f'{k} {v}' for k, v in axes.items())} = {product} do not divide into the "
                         f"{devices} devices (dp × cp × tp × pp must equal the device count); change a pin or the "
                         f"devices")
    if fixed.get("schedule") == "interleaved" and fixed.get("chunks", 2) < 2:
        raise ValueError(f"pins schedule 'interleaved' and chunks {fixed['chunks']} contradict: interleaving needs "
                         f"chunks >= 2")
    if "chunks" in fixed and fixed["chunks"] > 1 and fixed.get("schedule", "interleaved") != "interleaved":
        raise ValueError(f"pins chunks {fixed['chunks']} and schedule {fixed['schedule']!r} contradict: several "
                         f"chunks per rank need schedule 'interleaved'")
    if fixed.get("sequence_parallel") and fixed.get("tp") == 1:
        raise ValueError("pins sequence_parallel true and tp 1 contradict: sequence parallelism splits over tp")
    if fixed.get("async_tp") and fixed.get("tp") == 1:
        raise ValueError("pins async_tp true and tp 1 contradict: async_tp overlaps the tensor-parallel collectives")
    if fixed.get("zero_stage", 0) and fixed.get("dp") == 1:
        raise ValueError(f"pins zero_stage {fixed['zero_stage']} and dp 1 contradict: ZeRO shards over dp >= 2")
    piped = pipeline_pins(fixed)
    if piped and fixed.get("pp") == 1:
        raise ValueError(f"pins pp 1 and {', '.join(piped)} contradict: those need a pipeline (pp >= 2); pin pp to "
                         f"2 or more, or drop them")


def _options(name: str, default: list[Any], fixed: dict[str, Any]) -> list[Any]:
    return [fixed[name]] if name in fixed else default


def _schedule_options(pp: int, per: int, mb: int, space: Space, fixed: dict[str, Any],
                      n_layers: int, ckpt: str = "none") -> list[tuple[str, int, int]]:
    """(schedule, chunks, grad_accum) for a pipeline over ``per`` sequences per replica in micro-batches of mb.
    Selective recomputation runs under no zero-bubble schedule (their second, weight-gradient backward over a
    stage is what torch's selective checkpoint forbids; the runtime refuses the pair)."""
    if pp == 1:
        return [("1f1b", 1, per // mb)]
    out = []
    total = per // mb  # micro-batches per replica per step
    for schedule in _options("schedule", list(space.schedules), fixed):
        if ckpt == "selective" and schedule.startswith("zb"):
            continue
        if schedule != "interleaved" and fixed.get("chunks", 1) > 1:
            continue  # several chunks per rank: only the interleaved schedule runs them
        chunk_opts = _options("chunks", list(space.chunks), fixed) if schedule == "interleaved" else [1]
        for chunks in chunk_opts:
            if pp * chunks > n_layers or (schedule == "interleaved" and chunks < 2):
                continue
            # one flush per step (fewest bubbles); gpipe also fewer micro-batches per flush (less memory held)
            accums = divisors(total) if schedule == "gpipe" else [1]
            for accum in _options("grad_accum", accums, fixed):
                if not accum or total % accum:
                    continue
                m = total // accum
                if "microbatches" in fixed and fixed["microbatches"] != m:
                    continue
                if schedule == "interleaved" and m % pp:
                    continue
                out.append((schedule, chunks, accum))
    return out


def candidates(spec: ModelSpec, hw: Hardware, *, devices: int, global_batch: int, pins: dict[str, Any],
               space: Space, budget: float, runtime: str, cache: dict) -> tuple[Pool, dict]:
    """Every valid plan with its bounds, split by the memory bound; regions of invalid ones (see module doc).
    The exhaustive form of what ``groups.LazyPool`` expands on demand (tests compare the two)."""
    regions: dict = {}
    pool = Pool()
    hw_d = _hardware_for(hw, devices, cache)
    precision = pins.get("precision", space.precision)
    for tp, pp, dp in layouts(spec, hw, devices=devices, global_batch=global_batch, pins=pins, regions=regions):
        per = global_batch // dp
        for ckpt, sp, mbs, zeros in variants(spec, tp=tp, pp=pp, dp=dp, per=per, pins=pins, space=space):
            for i, mb in enumerate(mbs):
                least = _expand_mb(spec, hw_d, pool, regions, tp=tp, pp=pp, dp=dp, per=per, mb=mb, ckpt=ckpt, sp=sp,
                                   zeros=zeros, pins=pins, space=space, precision=precision, budget=budget,
                                   runtime=runtime, cache=cache)
                if least > _MB_STOP * budget and i + 1 < len(mbs):
                    # activations grow with the micro-batch (states do not change): when the least memory any
                    # candidate of this micro-batch needs is well over the budget, larger ones are over it too
                    note_mb_stop(regions, tp=tp, pp=pp, dp=dp, ckpt=ckpt, mb=mb, skipped=mbs[i + 1:], least=least)
                    break
    return pool, regions


def layouts(spec: ModelSpec, hw: Hardware, *, devices: int, global_batch: int, pins: dict[str, Any],
            regions: dict) -> list[tuple[int, int, int]]:
    """The valid ``(tp, pp, dp)`` of ``devices`` under the pins; the invalid ones noted in ``regions``."""
    _check_pins(pins, devices)
    n_layers = len(spec.layers)
    cp = pins.get("cp", 1)
    out = []
    for tp in _options("tp", divisors(devices), pins):
        if tp > 1 and not spec.tp_divisors:
            _note(regions, "invalid: the model has no tensor-parallel plan", 1, f"tp={tp} ({spec.name})")
            continue
        if any(d % tp for d in spec.tp_divisors):
            _note(regions, "invalid: tp does not divide the heads / widths", 1,
                  f"tp={tp} vs {list(spec.tp_divisors)}")
            continue
        if tp > hw.devices_per_node and "tp" not in pins:
            _note(regions, f"invalid: tp beyond one node of {hw.devices_per_node} (pin tp to allow)", 1, f"tp={tp}")
            continue
        for pp in divisors(devices // tp):
            if "pp" in pins and pp != pins["pp"]:
                continue
            if (devices // (tp * pp)) % cp:
                continue  # no dp × cp × tp × pp of the devices at this cp
            dp = devices // (tp * pp * cp)
            if "dp" in pins and dp != pins["dp"]:
                continue
            if (dp * cp) % pins.get("ep", 1):
                _note(regions, "invalid: ep does not divide dp × cp", 1, f"ep={pins['ep']} vs dp × cp = {dp * cp}")
                continue
            if pp > n_layers:
                _note(regions, "invalid: more pipeline stages than the model's units (blocks, embedding, head)", 1,
                      lambda: f"pp={pp} > {spec.units_text()}")
                continue
            if pp == 1 and pipeline_pins(pins):
                _note(regions, "invalid: the pins need a pipeline", 1,
                      lambda: f"pp=1 vs pinned {', '.join(pipeline_pins(pins))}")
                continue
            if global_batch % dp:
                _note(regions, "invalid: dp does not divide the global batch", 1,
                      f"dp={dp} vs global batch {global_batch}")
                continue
            out.append((tp, pp, dp))
    return out


def variants(spec: ModelSpec, *, tp: int, pp: int, dp: int, per: int, pins: dict[str, Any],
             space: Space) -> list[tuple[str, bool, list[int], list[int]]]:
    """``(recomputation, sequence parallelism, micro-batches in increasing order, ZeRO stages)`` of one layout."""
    zeros = space.pipeline_zero_stages if pp > 1 else space.zero_stages
    zeros = [z for z in _options("zero_stage", list(zeros), pins) if dp > 1 or z == 0]
    ckpts = _options("activation_checkpointing", list(space.checkpointing), pins)
    if not any(layer.kind == "block" for layer in spec.layers):
        ckpts = [c for c in ckpts if c == "none"] or ckpts  # no block to recompute
    sps = [s for s in _options("sequence_parallel", list(space.sequence_parallel), pins) if tp > 1 or not s]
    mbs = [mb for mb in _options("micro_batch", [m for m in divisors(per) if m <= space.max_micro_batch], pins)
           if per % mb == 0]
    return [(ckpt, sp, mbs, zeros) for ckpt in ckpts for sp in sps]


def async_tp_of(pins: Mapping[str, Any], tp: int) -> bool:
    """``Layout.async_tp`` of the search's candidates at ``tp``: the pin where tp > 1 (the search does not vary
    it: the overlap is the user's choice of runtime, as the precision is), else False."""
    return bool(pins.get("async_tp", False)) and tp > 1


def note_mb_stop(regions: dict, *, tp: int, pp: int, dp: int, ckpt: str, mb: int, skipped: list[int],
                 least: float) -> None:
    _note(regions, f"memory: micro-batches above one already over the budget (tp={tp} pp={pp})",
          len(skipped), f"dp={dp} tp={tp} pp={pp} mb {skipped} ckpt={ckpt}: mb={mb} needs ≥ "
                        f"{format_bytes(least, 2)}", need=least)


def note_over_memory(regions: dict, tp: int, pp: int, plan: Callable[[], Layout], need: float, count: int = 1) -> None:
    """Count ``count`` candidates whose memory bound is over the budget, the least of them ``need``; ``plan``
    makes that one (called only when it becomes the region's example)."""
    _note(regions, f"memory: bound over the budget (tp={tp} pp={pp})", count,
          lambda: f"{plan().describe()}: ≥ {format_bytes(need, 2)}", need=need)


_MB_STOP = 1.25
"""How far over the budget a micro-batch's least memory must be before larger micro-batches are skipped (the
margin covers a time-balanced cut that moves a layer between micro-batch sizes)."""


def _expand_mb(spec: ModelSpec, hw: Hardware, pool: Pool, regions: dict, *, tp: int, pp: int, dp: int, per: int,
               mb: int, ckpt: str, sp: bool, zeros: list[int], pins: dict[str, Any], space: Space, precision: str,
               budget: float, runtime: str, cache: dict, note: bool = True) -> float:
    """The candidates of one micro-batch size; returns the least memory floor among them. ``note``: count the
    ones over the budget in ``regions`` (``groups.LazyPool`` counted them when it bounded the group)."""
    cp, ep = pins.get("cp", 1), pins.get("ep", 1)
    async_tp = async_tp_of(pins, tp)
    base = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, micro_batch=mb, activation_checkpointing=ckpt, sequence_parallel=sp,
                  async_tp=async_tp, precision=precision)
    per_layer = layer_costs(spec, base, hw, cache)
    least = float("inf")
    for schedule, chunks, accum in _schedule_options(pp, per, mb, space, pins, len(spec.layers), ckpt):
        split = _split(spec, per_layer, pp * chunks, space, pins, cache, key=(tp, mb, ckpt, sp))
        for zero in zeros:
            plan = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero, micro_batch=mb, grad_accum=accum,
                        microbatches=(per // mb // accum) if pp > 1 else 0, schedule=schedule, chunks=chunks,
                        activation_checkpointing=ckpt, sequence_parallel=sp, async_tp=async_tp, precision=precision,
                        pp_split=split)
            cand = _bounds(spec, plan, hw, per_layer, runtime, cache, budget)
            pool.total += 1
            least = min(least, cand.memory_floor)
            if cand.memory_lb > budget:
                if note:
                    note_over_memory(regions, tp, pp, lambda: cand.plan, cand.memory_lb)
                pool.over_memory.append(cand)
            else:
                pool.feasible.append(cand)
    return least


def _split(spec: ModelSpec, per_layer: list[Any], n_stages: int, space: Space, pins: dict[str, Any], cache: dict,
           key: tuple) -> tuple[str, ...]:
    """Stage starts balancing predicted F + B + W (``()``: one stage, or parameter balance)."""
    if "pp_split" in pins:
        return tuple(pins["pp_split"])
    if n_stages == 1 or not space.time_balanced_split:
        return ()
    ck = ("split", key, n_stages)
    if ck not in cache:
        # integer weights for the partitioner: nanoseconds of one micro-batch's F + B + W
        starts = balance_minmax([c.F + c.B + c.W for c in per_layer], n_stages)
        cache[ck] = tuple(spec.layers[i].name for i in starts[1:])
    return cache[ck]


def _bounds(spec: ModelSpec, plan: Layout, hw: Hardware, per_layer: list[Any], runtime: str, cache: dict,
            budget: float = math.inf) -> Candidate:
    """The candidate's bounds; a plan whose memory bound is over ``budget`` gets ``time_lb`` 0 (never predicted,
    so its time is not worth bounding)."""
    opt = option_of(plan, cache)
    ((memory_lb, floor),) = memory_bounds(spec, [plan], opt, hw, cache)
    if memory_lb > budget:
        return Candidate(plan=plan, time_lb=0.0, memory_lb=memory_lb, memory_floor=floor)
    return Candidate(plan=plan, time_lb=time_bound(spec, plan, opt, hw, per_layer, runtime, cache),
                     memory_lb=memory_lb, memory_floor=floor)
