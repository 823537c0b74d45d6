"""The memory floor of a layout: per rank, the bytes its math needs and nothing the implementation adds.

Terms (bytes on one rank; Ψ = the rank's local parameter elements after tensor and pipeline parallelism,
``d`` = the ZeRO group, dp × cp):

=============  =====================================================================================================
``params``     p·Ψ, divided by d under ZeRO-3 (p = 4, or 2 in bf16-mixed: ``planner/memory.py``'s table)
``grads``      g·Ψ, divided by d under ZeRO-2/3 (g as p)
``optimizer``  (state + master)·Ψ, divided by d under ZeRO ≥ 1: state 0 (SGD), 4 (SGD with momentum), 8 (AdamW);
               master 4 in bf16-mixed
``gathered``   ZeRO-3 only: the current and the prefetched unit, 2 × the largest unit's Ψ in the compute dtype
               (a tied embedding is one unit, held while it is used, so it is at most that largest unit)
``casts``      bf16 autocast only: the 2-byte copies of the weights its GEMMs read, kept for backward (2·Ψ; under
               ZeRO-3 those of the two gathered units)
``activations`` what the schedule keeps for backward: the saved bytes of the sets it holds at its peak, chunk by
               chunk in its order (``pipeline_cost.held_bytes``; the planner's per-layer model, with the layout's
               recomputation), plus one layer's recomputed set
``logits``     the fp32 logits of one micro-batch (the loss's input and its gradient)
``comm``       communication buffers the code holds besides the above: ZeRO-2, the bucket filling and
               ``MAX_IN_FLIGHT`` buckets reducing; ZeRO-3, the same count of units' flat gradients (either at most
               all of the rank's gradients, g·Ψ: fewer groups than that exist); a pipeline,
               one activation message received and one sent (data parallelism's buckets *are* the gradients)
=============  =====================================================================================================

``step`` (bf16-mixed): the fp32 gradient shard the optimizer step reads, 4·Ψ/d (with the model states, after the
activations are freed: the floor is the larger of backward's and the step's).
``apart``: where gradients are allocated in backward and freed by the step, they and the activations peak at
opposite ends of backward (``planner/memory.py``'s ``_apart``): the smaller is subtracted from the total.
Pure: plain numbers from the planner's layer tables; nothing runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .context import local_spec
from .hardware import PRESETS, Hardware
from .layers import Layer
from .compute import act_bytes
from .memory import _PER_ELEMENT, _apart, frozen_local, held_by_rank, rank_parts, rank_states, step_grad_bytes
from .plan import Layout
from .spec import ModelSpec

__all__ = ["Floor", "rank_floor", "layout_floor", "phase_floors", "phase_allocations", "MAX_IN_FLIGHT", "TERMS", "PHASES"]

MAX_IN_FLIGHT = 1
"""Reductions a ZeRO-2/3 backward keeps outstanding besides the group filling (``parallel/zero/grads.py``'s
constant of the same name; a unit test holds them equal)."""

TERMS = ("params", "grads", "optimizer", "gathered", "casts", "activations", "logits", "comm")
PHASES = ("construction", "forward", "backward", "forward+backward", "step", "save", "eval")
"""The phases of a run the ledger measures (``runtime/memory_ledger.py``); a pipeline's interleaved forward and
backward passes are one phase, ``forward+backward``."""


@dataclass(frozen=True)
class Floor:
    """The floor of one pipeline rank, by term (bytes; see module docstring)."""

    params: float
    grads: float
    optimizer: float
    gathered: float
    casts: float
    activations: float
    logits: float
    comm: float
    apart: float = 0.0
    rank: int = 0
    step: float = 0.0
    """bf16-mixed: the fp32 gradient shard the optimizer step reads (``memory.step_grad_bytes``), live with the
    model states once the activations are freed."""

    @property
    def total(self) -> float:
        """The larger of backward's floor (every term, less ``apart``) and the step's (model states and ``step``)."""
        return max(sum(getattr(self, k) for k in TERMS) - self.apart,
                   self.params + self.grads + self.optimizer + self.step)

    @property
    def largest(self) -> str:
        """The name of the largest term."""
        return max(TERMS, key=lambda k: getattr(self, k))

    def to_json(self) -> dict[str, Any]:
        return {**{k: getattr(self, k) for k in TERMS}, "apart": self.apart, "step": self.step, "total": self.total,
                "largest": self.largest, "pipeline_rank": self.rank}


def rank_floor(layers: Sequence[Layer], chunk_layers: Sequence[Sequence[Layer]], in_flight: int, plan: Layout, *,
               bucket_bytes: float = 25 * 2**20, boundary: float = 0.0, rank: int = 0,
               held: float | None = None) -> Floor:
    """The floor of one pipeline rank holding ``layers`` (its chunks' in ``chunk_layers``) with ``in_flight``
    chunk activation sets kept at the peak (the schedule simulator's count). ``bucket_bytes``: ZeRO-2's bucket
    cap; ``boundary``: bytes of one activation message between stages (0 without a pipeline); ``held``: the
    bytes of the sets at the peak, by chunk (``memory.held_by_rank``), else ``in_flight`` × the mean chunk's."""
    n, per_chunk, transient, biggest, loss, _, _, experts = rank_parts(layers, chunk_layers, plan)
    frozen = frozen_local(layers, plan.tp, plan.ep)  # a frozen base: parameter bytes only
    states = rank_states(n, experts, frozen, plan)  # routed experts shard over their own group
    n -= frozen  # from here on: the elements with a gradient
    p_bytes, g_bytes, _ = _PER_ELEMENT[plan.precision]
    sharded = plan.zero_group > 1
    gathered = 2 * biggest * p_bytes if plan.zero_stage >= 3 and sharded else 0.0
    # bf16 autocast keeps a 2-byte copy of each weight a GEMM read, for backward: of the gathered units only under
    # ZeRO-3, of every local weight otherwise
    casts = 0.0 if plan.precision != "bf16" else 2 * (2 * biggest if gathered else n + frozen)
    comm = 0.0
    # a group filling and MAX_IN_FLIGHT reducing, never more than all of the rank's gradients (one group then)
    if plan.pp > 1 and plan.zero_stage >= 2 and sharded:
        # a pipeline reduces once per step: the full gradients wait for it, and become the shard there
        comm = n * g_bytes - states.grads
    elif plan.zero_stage == 2 and sharded:
        comm = min(n * g_bytes, (1 + MAX_IN_FLIGHT) * bucket_bytes)
    elif plan.zero_stage >= 3 and sharded:
        comm = min(n * g_bytes, (1 + MAX_IN_FLIGHT) * biggest * g_bytes)
    if plan.pp > 1:
        comm += 2 * boundary
    activations = (in_flight * per_chunk if held is None else held) + transient
    return Floor(params=states.params, grads=states.grads, optimizer=states.optimizer, gathered=gathered,
                 casts=casts, activations=activations, logits=loss, comm=comm, apart=_apart(plan, activations, states.grads),
                 rank=rank, step=step_grad_bytes(states, plan.precision, plan.optimizer))


def layout_floor(spec: ModelSpec, plan: Layout, *, global_batch: int, hardware: Hardware | None = None,
                 bucket_bytes: float = 25 * 2**20) -> list[Floor]:
    """The floor of every pipeline rank of ``plan`` (one entry without a pipeline). The schedule's in-flight
    micro-batches come from the planner's simulator on ``hardware`` (default: a preset; the count depends on the
    schedule, barely on the speeds). ``ValueError`` as ``predict`` when the plan does not fit the model."""
    from .predict import _check, _flush, _hardware_for, layer_costs, stages_of  # the planner's own steps

    hw = hardware or PRESETS["h100-80g-sxm"]
    plan = plan.resolved(global_batch)
    _check(spec, plan, hw)
    spec = local_spec(spec, plan, None)
    hw = _hardware_for(hw, plan.devices, None)
    stages = stages_of(spec, plan)
    per_layer = layer_costs(spec, plan, hw)
    starts = [sum(len(st) for st in stages[:i]) for i in range(len(stages))]
    costs = [per_layer[a:a + len(st)] for a, st in zip(starts, stages)]
    in_flight = _flush(plan, costs, stages, hw, blocking=False, cache=None).in_flight if plan.pp > 1 else [1]
    ranks = [[s for s in range(len(stages)) if s % plan.pp == r] for r in range(plan.pp)]
    boundary = plan.micro_batch * spec.seq_len * spec.hidden * act_bytes(plan) / (plan.tp if plan.sequence_parallel else 1)
    out, held = [], held_by_rank(stages, plan)
    for r, owned in enumerate(ranks):
        chunk_layers = [stages[s] for s in owned]
        layers = [layer for chunk in chunk_layers for layer in chunk]
        out.append(rank_floor(layers, chunk_layers, int(in_flight[r]), plan, bucket_bytes=bucket_bytes,
                              boundary=boundary, rank=r, held=held[r]))
    return out



def persistent_grads(plan: Layout) -> bool:
    """Whether the rank's gradients live in buffers that persist between steps (data parallelism's buckets,
    ZeRO-1's flat groups), rather than being allocated in backward and freed by the step."""
    return plan.zero_stage == 1 or (plan.zero_stage == 0 and plan.zero_group > 1 and plan.pp == 1)


def phase_floors(floor: Floor, plan: Layout) -> dict[str, float]:
    """The floor of each phase (``PHASES``), from the terms live in it: construction holds the parameters (and
    persistent gradient buffers); forward adds the optimizer state, the gathered units and the activations;
    backward and a pipeline's forward+backward hold the whole floor; the step holds the model states; a save
    and an evaluation the model states less released gradients (an evaluation: one micro-batch's logits)."""
    kept = floor.grads if persistent_grads(plan) else 0.0
    states = floor.params + kept + floor.optimizer
    return {"construction": floor.params + kept,
            "forward": states + floor.gathered + floor.casts + floor.activations + floor.logits,
            "backward": floor.total, "forward+backward": floor.total,
            "step": floor.params + floor.grads + floor.optimizer + floor.step,
            "save": states, "eval": states + floor.gathered + floor.logits}


def phase_allocations(floor: Floor, plan: Layout) -> dict[str, float]:
    """Of each phase's floor, the bytes the phase itself allocates in a steady step (what its rise above its
    start may hold without exceeding the floor): construction its whole floor; forward the gathered units, the
    activations and the logits; backward the released gradients and the communication buffers; a pipeline's
    forward+backward both; the step nothing (the optimizer state is allocated once, in the first step); a save
    nothing; an evaluation its gathered units and logits."""
    released = 0.0 if persistent_grads(plan) else floor.grads
    forward = floor.gathered + floor.casts + floor.activations + floor.logits
    return {"construction": phase_floors(floor, plan)["construction"], "forward": forward,
            "backward": released + floor.comm, "forward+backward": forward + released + floor.comm,
            "step": floor.step, "save": 0.0, "eval": floor.gathered + floor.logits}
