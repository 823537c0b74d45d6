"""``predict(spec, plan, hardware, global_batch=...)``: step time and memory of a layout before it runs.

One step = ``grad_accum`` pipeline flushes (or passes) + the exposed data-parallel / ZeRO communication + the
optimizer. A flush is simulated with per-stage costs (``pipeline_cost``); a stage's costs are its layers'
(``compute``); memory is the most loaded pipeline rank's (``memory``). FLOP counts follow Megatron-LM:
``tflops_per_device`` counts what the devices execute, recomputation included (Narayanan et al. 2021, Eq. 3,
attention counted in full), ``mfu`` counts model FLOPs only (3 × forward, Korthikanti et al. 2022 App. A)
over the dense peak of the compute precision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from . import tp_overlap
from .builders import gpt_layers
from .compute import LayerTime, act_bytes, layer_time
from .context import local_spec, with_ring
from .hardware import Hardware
from .memory import MemoryBreakdown, frozen_local, held_by_rank, local_params, rank_memory, runtime_bytes
from .overhead import autocast_factor, with_launch_cost
from .pipeline_cost import Flush, simulate_flush, split_at, split_stages
from .plan import Layout
from .spec import ModelSpec
from .step_extras import fused_optimizer as fused_for, optimizer_time, step_syncs
from .dp_comm import _dp_comm, dp_comm
from .moe import check_ep, expert_local, optimizer_elements

__all__ = ["Prediction", "predict"]


@dataclass(frozen=True)
class Prediction:
    """What ``predict`` says about one plan."""

    plan: Layout
    step_time_s: float
    tokens_per_s: float
    tflops_per_device: float
    mfu: float
    memory: MemoryBreakdown
    breakdown: dict[str, float]
    """Seconds per step: compute, tp_comm, pipeline_bubble, dp_comm, optimizer (they sum to the step)."""
    stages: list[dict[str, Any]] = field(default_factory=list)
    """Per pipeline stage: layers, F/B/W seconds per micro-batch."""
    hardware: str = ""
    model: str = ""
    params: int = 0
    """The model's parameters (all experts counted)."""
    active_params: int = 0
    """Of which one token passes through (``ModelSpec.active_params``; equal to ``params`` for a dense model)."""

    def params_text(self) -> str:
        """``"46.7 B"`` for a dense model, ``"46.7 B total, 12.9 B active"`` for a mixture of experts."""
        total = _count(self.params)
        return total if self.active_params == self.params else f"{total} total, {_count(self.active_params)} active"

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def dominant(self) -> str:
        """The largest term of the step-time breakdown."""
        return max(self.breakdown, key=lambda k: self.breakdown[k])

    def to_json(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "tflops_per_device": self.tflops_per_device, "mfu": self.mfu, "fits": self.fits,
                "memory": self.memory.to_json(), "breakdown": dict(self.breakdown), "dominant": self.dominant,
                "plan": self.plan.to_json(), "stages": self.stages, "hardware": self.hardware, "model": self.model,
                **({"params": self.params, "active_params": self.active_params}
                   if self.active_params != self.params else {})}


def _count(n: int) -> str:
    """A parameter count in thousands, millions or billions (``"12.9 B"``)."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def _check(spec: ModelSpec, plan: Layout, hw: Hardware) -> None:
    if plan.tp > 1:
        if not spec.tp_divisors:
            raise ValueError(f"tp = {plan.tp}: model {spec.name!r} has no tensor-parallel plan the planner knows "
                             f"(a traced model); use tp = 1")
        bad = [d for d in spec.tp_divisors if d % plan.tp]
        if bad:
            raise ValueError(f"tp = {plan.tp} must divide the model's heads / widths {list(spec.tp_divisors)} "
                             f"({bad} do not divide); use a tp that divides all of them")
    if plan.pp * plan.chunks > len(spec.layers):
        raise ValueError(f"pp × chunks = {plan.pp} × {plan.chunks} stages exceed the model's "
                         f"{spec.units_text()}; use fewer stages")
    if plan.sequence_parallel and plan.tp == 1:
        raise ValueError("sequence_parallel needs tp > 1; set tp >= 2 or sequence_parallel = False")
    if plan.async_tp and plan.tp == 1:
        raise ValueError("async_tp needs tp > 1 (it overlaps the tensor-parallel collectives); set tp >= 2 or "
                         "async_tp = False")
    plan.check_seq_len(spec.seq_len)
    check_ep(spec, plan)


def layer_costs(spec: ModelSpec, plan: Layout, hw: Hardware, cache: dict | None = None) -> list[LayerTime]:
    """Every layer's ``LayerTime`` for one micro-batch under ``plan`` (memoised in ``cache`` by what it depends
    on: tp, micro-batch, recomputation, sequence parallelism, precision; with ``async_tp`` also the devices and
    the schedule)."""
    key = ("layers", id(hw), plan.tp, plan.micro_batch, plan.activation_checkpointing, plan.sequence_parallel,
           plan.precision) + ((plan.cp,) if plan.cp > 1 else ()) + (("ep", plan.ep) if plan.ep > 1 else ())
    if plan.async_tp:  # the overlap also depends on the ranks sharing a host, a deferred weight gradient and
        # how the pieces are assembled (``tp_overlap.IN_PLACE_PIECES``, a module switch read at call time)
        key += ("async_tp", plan.devices, plan.pp > 1 and plan.schedule in ("zb-h1", "zb-h2"),
                tp_overlap.IN_PLACE_PIECES)
    if cache is not None and key in cache:
        return cache[key]
    tp_per_node = min(plan.tp, hw.devices_per_node)
    flash = spec.attention == "flash"
    # identical layers (a transformer's blocks differ only in name) are costed once, on their first occurrence
    classes_key = ("layer classes", id(spec))
    classes = cache.get(classes_key) if cache is not None else None
    if classes is None:
        classes = _layer_classes(spec)
        if cache is not None:
            cache[classes_key] = classes
    firsts, index = classes
    costed = [layer_time(spec.layers[i], plan, hw, flash=flash, tp_per_node=tp_per_node) for i in firsts]
    if plan.cp > 1:
        costed = [with_ring(spec, spec.layers[i], t, plan, hw, flash) for i, t in zip(firsts, costed)]
    out = [costed[c] for c in index]
    if cache is not None:
        cache[key] = out
    return out


def _layer_classes(spec: ModelSpec) -> tuple[list[int], list[int]]:
    """``(first layer index of each class, class of each layer)``: layers equal but for their name are one
    class (a dataclass hash per layer is dear; the search asks for hundreds of (tp, micro-batch, ...) costs)."""
    first: dict[Any, int] = {}
    firsts: list[int] = []
    index = []
    for i, layer in enumerate(spec.layers):
        same = replace(layer, name="")
        if same not in first:
            first[same] = len(firsts)
            firsts.append(i)
        index.append(first[same])
    return firsts, index


def stages_of(spec: ModelSpec, plan: Layout) -> list[list[Any]]:
    """The plan's pipeline stages: cut at ``plan.pp_split``, else balanced by parameters."""
    n = plan.pp * plan.chunks
    return split_at(spec.layers, plan.pp_split) if plan.pp_split else split_stages(spec.layers, n)


def flush_inputs(plan: Layout, costs: list[list[LayerTime]], stages: list[list[Any]], hw: Hardware,
                 blocking: bool) -> tuple[list[float], list[float], list[float], list[float]]:
    """Per-stage F, B, W seconds of one micro-batch and per-boundary transfer seconds, as the simulator takes
    them (blocking transfers folded into the compute)."""
    F, B, W = stage_sums(costs)
    return fold_transfers(plan, F, B, W, stages, hw, blocking)


def stage_sums(costs: list[list[LayerTime]]) -> tuple[list[float], list[float], list[float]]:
    return ([sum(c.F for c in st) for st in costs], [sum(c.B for c in st) for st in costs],
            [sum(c.W for c in st) for st in costs])


def fold_transfers(plan: Layout, F: list[float], B: list[float], W: list[float], stages: list[list[Any]],
                   hw: Hardware, blocking: bool) -> tuple[list[float], list[float], list[float], list[float]]:
    """The boundary transfers of ``stages`` (and, when ``blocking``, F and B with them folded in)."""
    F, B = list(F), list(B)
    # One boundary carries the micro-batch's hidden state; Megatron's scatter/gather sends 1/t of it per rank
    # across and all-gathers it inside the receiving tensor-parallel group.
    crosses = plan.tp * plan.dp * plan.cp >= hw.devices_per_node and plan.devices > hw.devices_per_node
    comm = []
    for st in stages[:-1]:
        nbytes = st[-1].hidden * plan.micro_batch * act_bytes(plan)
        one = hw.p2p_time(nbytes / plan.tp, cross_node=crosses) + hw.sync_skew_s  # a receive waits for its peer
        if plan.tp > 1:
            one += hw.collective_time("all_gather", nbytes, plan.tp, per_node=min(plan.tp, hw.devices_per_node),
                                      algorithm="native")
        comm.append(one)
    if blocking and len(stages) > 1:
        # sends and receives hold the rank's stream: F waits for its input and its send, B likewise
        for s in range(len(stages)):
            edge = (comm[s - 1] if s > 0 else 0.0) + (comm[s] if s < len(comm) else 0.0)
            F[s] += edge
            B[s] += edge
    return F, B, W, comm


def shares_cores(plan: Layout, hw: Hardware) -> bool:
    """Pipeline ranks share a host's cores (a CPU calibration with more ranks than cores)."""
    return bool(hw.host_cores) and plan.devices > hw.host_cores and plan.pp > 1


def _flush(plan: Layout, costs: list[list[LayerTime]], stages: list[list[Any]], hw: Hardware, blocking: bool,
           cache: dict | None = None) -> Flush:
    F, B, W, comm = flush_inputs(plan, costs, stages, hw, blocking)
    m = plan.microbatches if plan.pp > 1 else 1
    key = ("flush", plan.schedule, plan.pp, m, plan.chunks, tuple(F), tuple(B), tuple(W), tuple(comm))
    flush = cache.get(key) if cache is not None else None
    if flush is None:
        flush = simulate_flush(plan.schedule, plan.pp, m, plan.chunks, F, B, W, comm)
        if cache is not None:
            cache[key] = flush
    cores = hw.host_cores
    if shares_cores(plan, hw):
        # ranks share a host's cores: while a pipeline rank idles in the bubble, the busy ones get its share.
        # Greedy sharing of C cores among the ranks' work is bounded by Graham's list-scheduling bound,
        # T <= W / C + T_cp · (1 - 1/C): at full-core speed the total work W over C cores is the mean busy
        # time and the critical path T_cp is the unshared flush time × C/n.
        n = min(plan.devices, hw.devices_per_node)
        mean_busy = sum(flush.busy) / len(flush.busy)
        shared = min(flush.time, mean_busy + flush.time * cores / n * (1 - 1 / cores))
        flush = Flush(time=shared, busy=flush.busy, in_flight=flush.in_flight)
    return flush


def block_factors(hw: Hardware) -> Hardware:
    """``hw`` with ``fwd_factor`` / ``bwd_factor`` (and ``recompute_factor`` where the file has the
    checkpointed probe) from its measured probe block (unchanged without one): the block is predicted on
    ``hw``'s own GEMM and bandwidth numbers, measured over predicted is the factor."""
    probe = hw.block_probe
    if not probe or (hw.fwd_factor, hw.bwd_factor) != (1.0, 1.0):
        return hw
    h, a, s, b = (int(probe[k]) for k in ("n_embd", "n_head", "seq", "batch"))
    block = gpt_layers(n_layer=1, h=h, a=a, v=8, s=s, positions=s, tie=True, bias=True, dropout=False,
                       attention="flash")[1]
    as_probed = lambda h: h.for_devices(h.calibrated_ranks) if h.calibrated_ranks else h  # noqa: E731
    if "tiny_s" in probe:
        # a launch's cost in eager training, from the tiny block (``overhead.py``), before the factors: they
        # then scale what grows with the work, and a small micro-batch keeps its fixed per-launch cost
        launch = with_launch_cost(as_probed(hw), probe["tiny_s"], gpu=hw.kind == "gpu", tiny2_s=probe.get("tiny2_s"))
        hw = replace(hw, op_overhead_s=launch.op_overhead_s, host_launch_s=launch.host_launch_s,
                     autocast_launch_factor=autocast_factor(probe["tiny_s"], probe.get("tiny_ac_s")))
    probe_hw = as_probed(hw)
    t = layer_time(block, Layout(micro_batch=b), probe_hw, flash=True, tp_per_node=1)
    recompute = hw.recompute_factor
    if "ckpt_s" in probe:
        # checkpointing's extra over plain forward + backward, in measured forwards (never below nothing)
        recompute = max(probe["ckpt_s"] - probe["fwd_s"] - probe["bwd_s"], 0.0) / probe["fwd_s"]
    return replace(hw, fwd_factor=probe["fwd_s"] / t.F, bwd_factor=probe["bwd_s"] / (t.B + t.W),
                   recompute_factor=recompute)


def predict(spec: ModelSpec, plan: Layout, hardware: Hardware, *, global_batch: int, seq_len: int | None = None,
            runtime: str = "shardwise", cache: dict | None = None, fused_optimizer: bool | None = None) -> Prediction:
    """Predict one training step of ``spec`` laid out by ``plan`` on ``hardware`` (see module doc).

    ``runtime`` names the implementation that runs the plan: ``shardwise`` (gradient buckets reduce during the
    last backward; pipeline sends and receives are asynchronous) or ``megatron`` (Megatron-LM as published in
    2021: the data-parallel reduction runs after the flush, pipeline transfers block the compute stream).
    ``ValueError`` when the plan does not fit the model or the batch; a plan that does not fit in memory is
    *not* an error: ``prediction.fits`` is False. ``cache``: a dict kept across calls for one ``spec`` and
    ``hardware`` (the search's), memoising layer costs and flush simulations. ``fused_optimizer``: whether
    AdamW runs as one fused kernel; None = what the runtime does (Megatron: fused; shardwise train: fused on GPUs
    with ``optimizer.implementation = auto``, torch's loop on CPU ranks).
    """
    if seq_len is not None:
        spec = spec.with_seq_len(seq_len)
    plan = plan.resolved(global_batch)
    _check(spec, plan, hardware)
    spec = local_spec(spec, plan, cache)
    if runtime not in ("shardwise", "megatron"):
        raise ValueError(f"runtime must be 'shardwise' or 'megatron', got {runtime!r}")
    hardware = _hardware_for(hardware, plan.devices, cache)
    n_stages = plan.pp * plan.chunks
    stages = stages_of(spec, plan)
    per_layer = layer_costs(spec, plan, hardware, cache)
    starts = [sum(len(st) for st in stages[:i]) for i in range(len(stages))]  # stages are contiguous slices
    costs = [per_layer[a:a + len(st)] for a, st in zip(starts, stages)]
    flush = _flush(plan, costs, stages, hardware, blocking=runtime == "megatron", cache=cache)
    ranks = [[s for s in range(n_stages) if s % plan.pp == r] for r in range(plan.pp)]
    # the bottleneck rank sets the data-parallel window and the memory
    bottleneck = max(range(plan.pp), key=lambda r: flush.busy[r])
    rank_layers = [[layer for s in ranks[r] for layer in stages[s]] for r in range(plan.pp)]
    n_local, n_expert, n_frozen = max((sum(local_params(layer, plan.tp, plan.ep) for layer in rl),
                                       sum(expert_local(layer, plan.tp, plan.ep) for layer in rl),
                                       frozen_local(rl, plan.tp, plan.ep)) for rl in rank_layers)
    tensors = max(len(rl) for rl in rank_layers) * 12
    last_b = sum(c.B + c.W for s in ranks[bottleneck] for c in costs[s])
    last_f = sum(c.F for s in ranks[bottleneck] for c in costs[s])
    units = max(len(rl) for rl in rank_layers)
    dp = dp_comm(plan, hardware, n_local, last_b, last_f, runtime == "shardwise", units, n_expert, n_frozen)
    opt = optimizer_time(plan, hardware, optimizer_elements(plan, n_local - n_frozen, n_expert), tensors,
                         fused=fused_for(runtime, hardware) if fused_optimizer is None else fused_optimizer,
                         multi_tensor=runtime == "shardwise")
    if runtime == "shardwise":
        flag, loss = step_syncs(plan, hardware)
        opt, dp = opt + flag, dp + loss
    step = plan.grad_accum * flush.time + dp + opt
    return _assemble(spec, plan, hardware, stages, costs, flush, ranks, rank_layers, step, dp, opt, global_batch)


def _hardware_for(hw: Hardware, devices: int, cache: dict | None) -> Hardware:
    key = ("hw", id(hw), devices)
    if cache is not None and key in cache:
        return cache[key]
    out = block_factors(hw).for_devices(devices)
    if cache is not None:
        cache[key] = out
    return out


def _assemble(spec: ModelSpec, plan: Layout, hw: Hardware, stages: list[list[Any]], costs: list[list[LayerTime]],
              flush: Flush, ranks: list[list[int]], rank_layers: list[list[Any]], step: float, dp: float,
              opt: float, global_batch: int) -> Prediction:
    m = plan.microbatches if plan.pp > 1 else 1
    r = max(range(plan.pp), key=lambda i: flush.busy[i])
    tp = plan.grad_accum * m * sum(c.tp_fwd + c.tp_bwd for s in ranks[r] for c in costs[s])
    busy = min(plan.grad_accum * flush.busy[r], plan.grad_accum * flush.time)  # a shared host fills bubbles
    breakdown = {"compute": busy - tp, "tp_comm": tp, "pipeline_bubble": plan.grad_accum * flush.time - busy,
                 "dp_comm": dp, "optimizer": opt}
    if plan.cp > 1:  # the ring's exposed hops, named apart from compute
        cp = plan.grad_accum * m * sum(c.cp_fwd + c.cp_bwd for s in ranks[r] for c in costs[s])
        breakdown = {"compute": busy - tp - cp, "tp_comm": tp, "cp_comm": cp, **{k: v for k, v in breakdown.items()
                                                                                if k not in ("compute", "tp_comm")}}
    if plan.ep > 1:  # the expert-parallel all-to-alls, named apart from compute
        ep = plan.grad_accum * m * sum(c.ep_fwd + c.ep_bwd for s in ranks[r] for c in costs[s])
        breakdown = {"compute": breakdown["compute"] - ep, "ep_comm": ep,
                     **{k: v for k, v in breakdown.items() if k != "compute"}}
    # FLOPs per step over all devices: forward GEMMs × (1 forward + 2 backward + 1 recomputed forward), × cp ranks
    fwd = sum(c.flops_fwd for st in costs for c in st) * plan.tp * plan.cp  # the whole model, one micro-batch
    attn = sum(c.flops_attn for st in costs for c in st) * plan.tp * plan.cp
    blocks_fwd = sum(c.flops_fwd for st, lst in zip(costs, stages) for c, layer in zip(st, lst)
                     if layer.kind == "block") * plan.tp * plan.cp
    recompute = {"none": 0.0, "full": blocks_fwd, "selective": attn}[plan.activation_checkpointing]
    micro_batches = global_batch / plan.micro_batch
    model_flops = 3 * fwd * micro_batches
    hw_flops = (3 * fwd + recompute) * micro_batches
    peak = hw.peak_flops["fp32" if plan.precision == "fp32" else "bf16"]
    memories, held = [], held_by_rank(stages, plan)
    for i in range(plan.pp):
        chunk_layers = [stages[s] for s in ranks[i]]
        memories.append(rank_memory(rank_layers[i], chunk_layers, flush.in_flight[i], plan, hw.memory_bytes,
                                    bucket_cap=_bucket_cap(plan), rank=i, runtime=runtime_bytes(hw.kind),
                                    held=held[i]))
    memory = max(memories, key=lambda mb: mb.total)
    stage_rows = [{"stage": s, "layers": [layer.name for layer in stages[s]], "F_s": sum(c.F for c in costs[s]),
                   "B_s": sum(c.B for c in costs[s]), "W_s": sum(c.W for c in costs[s])} for s in range(len(stages))]
    return Prediction(plan=plan, step_time_s=step, tokens_per_s=global_batch * spec.seq_len / step,
                      tflops_per_device=hw_flops / step / plan.devices / 1e12,
                      mfu=model_flops / step / plan.devices / peak, memory=memory, breakdown=breakdown,
                      stages=stage_rows, hardware=hw.name, model=spec.name, params=spec.params,
                      active_params=spec.active_params)


def _bucket_cap(plan: Layout) -> float:
    """Gradient buckets in flight when data parallelism reduces: two of 25 MB (fewer bytes when the rank's
    gradients are smaller: ``rank_memory`` caps it)."""
    return 2 * 25e6 if plan.dp > 1 and plan.zero_stage < 3 else 0.0
