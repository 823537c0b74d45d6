"""Memory per device: model states (Rajbhandari et al. 2019, "ZeRO", §3 and Table 1) and activations
(Korthikanti et al. 2022, "Reducing Activation Recomputation", §4) for one pipeline rank.

Model states per parameter element held by a rank (after tensor and pipeline parallelism):

=============  ==========  =====  ==================================================
precision      parameters  grads  optimizer (AdamW)
=============  ==========  =====  ==================================================
fp32           4           4      8 (m, v)
bf16           4           4      8 — autocast keeps fp32 weights; GEMMs read 2-byte casts (``buffers``)
bf16-mixed     2           2      12 (fp32 master, m, v) — the ZeRO paper's 2Ψ + 2Ψ + KΨ, K = 12
=============  ==========  =====  ==================================================

ZeRO over ``dp`` (× ``cp``: context-parallel ranks hold the same parameters) divides the optimizer state
(stage ≥ 1), the gradients (≥ 2) and the parameters (3). Context parallelism's activations are those of the
rank's ``S/cp`` tokens (``predict`` hands ``rank_memory`` the cp rank's layers, ``ModelSpec.for_cp``).

Construction (``construction_bytes``): a rank builds its model from the meta device and keeps its pieces, so while
the model is built (and loaded) it holds its kept parameters (with ZeRO also the gradient buffers it allocates
then) plus the largest full tensor it slices: tensor parallelism reads a row-split matrix whole; ZeRO-3 reads
its flat ranges directly and a rank that keeps whole tensors (data parallelism, a pipeline stage) builds them
in place — nothing more. The
device's peak is the larger of that and the training peak (``MemoryBreakdown.total``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .compute import act_bytes
from .plan import Layout
from .layers import Layer
from .moe import expert_local

__all__ = ["StateBytes", "model_state_bytes", "step_grad_bytes", "layer_activation_bytes", "MemoryBreakdown", "largest_tensor",
           "construction_bytes", "runtime_bytes", "rank_states", "frozen_local", "CPU_RUNTIME_BYTES", "optimizer_bytes_per_element",
           "stage_activation_bytes", "held_by_rank"]

_PER_ELEMENT = {"fp32": (4, 4, 8), "bf16": (4, 4, 8), "bf16-mixed": (2, 2, 12)}


@dataclass(frozen=True)
class StateBytes:
    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


_STATE = {"adamw": 8, "sgd-momentum": 4, "sgd": 0}
"""Optimizer-state bytes per fp32 parameter element (``Layout.optimizer``); ``bf16-mixed`` adds its 4-byte master."""


def optimizer_bytes_per_element(precision: str, optimizer: str = "adamw") -> int:
    """Bytes of optimizer state per parameter element: the moments of ``optimizer`` plus, with ``bf16-mixed``, the
    fp32 master copy (AdamW: 8 in fp32 and bf16 autocast, 12 in bf16-mixed — the ZeRO paper's K)."""
    return _STATE[optimizer] + (4 if precision == "bf16-mixed" else 0)


def step_grad_bytes(states: StateBytes, precision: str, optimizer: str = "adamw") -> float:
    """bf16-mixed: bytes of the fp32 gradient the optimizer step reads for this rank's master elements (torch's
    optimizers update an fp32 master with an fp32 gradient: the bf16 shard is cast for the step), 4 per element
    the optimizer holds; 0 in fp32 and bf16 autocast (the gradients are fp32 already). Not in the ZeRO paper's
    2 + 2 + 12 accounting, which counts what persists between steps."""
    if precision != "bf16-mixed":
        return 0.0
    return 4 * states.optimizer / optimizer_bytes_per_element(precision, optimizer)


def model_state_bytes(n_params: float, *, precision: str, zero_stage: int, dp: int,
                      optimizer: str = "adamw") -> StateBytes:
    """Bytes of parameters, gradients and optimizer state (AdamW unless ``optimizer`` says otherwise) for
    ``n_params`` elements on one rank of ``dp``."""
    p, g, _ = _PER_ELEMENT[precision]
    o = optimizer_bytes_per_element(precision, optimizer)
    return StateBytes(params=p * n_params / (dp if zero_stage >= 3 else 1),
                      grads=g * n_params / (dp if zero_stage >= 2 else 1),
                      optimizer=o * n_params / (dp if zero_stage >= 1 else 1))


def frozen_local(layers: Sequence[Layer], tp: int, ep: int = 1) -> float:
    """Frozen parameter elements of ``layers`` on one tensor-parallel rank: all but their trainable
    ``params - frozen``, which are counted whole (adapters: small, mostly replicated)."""
    return sum(max(0.0, local_params(x, tp, ep) - (x.params - x.frozen)) for x in layers if x.frozen)


def rank_states(n: float, experts: float, frozen: float, plan: Layout) -> StateBytes:
    """Model-state bytes of a rank holding ``n`` parameter elements, ``experts`` of them routed experts' (sharded
    over ``Layout.expert_group``) and ``frozen`` of them frozen (parameter bytes only: sharded by ZeRO-3 over the
    same group as the trainable ones, inside a pipeline too — ``parallel/pipeline/zero3.py``'s frozen groups)."""
    def of(count: float, group: int) -> StateBytes:
        return model_state_bytes(count, precision=plan.precision, zero_stage=plan.zero_stage, dp=group,
                                 optimizer=plan.optimizer)
    dense, own = of(max(0.0, n - experts - frozen), plan.zero_group), of(experts, plan.expert_group)
    shard = plan.zero_group if plan.zero_stage >= 3 else 1
    held = _PER_ELEMENT[plan.precision][0] * frozen / shard
    return StateBytes(params=dense.params + own.params + held, grads=dense.grads + own.grads,
                      optimizer=dense.optimizer + own.optimizer)


def local_params(layer: Layer, tp: int, ep: int = 1) -> float:
    """Parameter elements of ``layer`` on one tensor-parallel rank (holding ``1/ep`` of its routed experts)."""
    if layer.replicated:
        whole = float(layer.params)
    else:
        whole = layer.tp_params / tp + (layer.params - layer.tp_params)
    if ep > 1 and layer.expert_params:
        whole -= expert_local(layer, tp, 1) - expert_local(layer, tp, ep)
    return whole


def largest_tensor(layer: Layer) -> float:
    """Elements of ``layer``'s largest full parameter tensor: ``Layer.largest``, else its largest weight GEMM,
    else (nothing known) all of its parameters."""
    if layer.largest:
        return float(layer.largest)
    return float(max((g.k * g.n for g in layer.gemms if g.weight), default=layer.params))


def construction_bytes(kept_params: float, *, in_flight: float, precision: str) -> float:
    """Peak bytes of one rank while it builds (or loads) its model: its kept parameter bytes plus the
    ``in_flight`` elements of the one full tensor it is slicing (0 when it keeps whole tensors)."""
    return kept_params + in_flight * _PER_ELEMENT[precision][0]


def layer_activation_bytes(layer: Layer, plan: Layout) -> tuple[float, float]:
    """``(kept, transient)`` bytes of one micro-batch through ``layer`` on one rank: what backward needs under
    the plan's recomputation, and the full set that exists again while this layer is recomputed."""
    if layer.replicated and plan.tp > 1:
        plan = replace(plan, tp=1, sequence_parallel=False)
    t, b, eb = plan.tp, plan.micro_batch, act_bytes(plan)
    rep = layer.act_rep / (t if plan.sequence_parallel else 1)
    full = (rep + layer.act_tp / t + layer.act_attn / t) * b * eb + layer.act_fp32 / t * b * 4
    if layer.kind != "block" or plan.activation_checkpointing == "none":
        return full, 0.0
    if plan.activation_checkpointing == "full":
        kept = layer.hidden * b * eb / (t if plan.sequence_parallel else 1)  # the block's input only
        return kept, full
    # selective (parallel/common/selective.py): the weight GEMMs' outputs are kept, with the block's input;
    # everything else (attention core, norms, activation function, residuals) is recomputed
    kept = min(full, (layer.hidden / (t if plan.sequence_parallel else 1) + _gemm_outputs(layer, t)) * b * eb)
    return kept, full - kept


def stage_activation_bytes(stage_layers: Sequence[Sequence[Layer]], plan: Layout) -> list[float]:
    """Kept bytes of one micro-batch through each stage (``layer_activation_bytes`` summed over its layers): what
    a forward of that stage adds to the stash (``pipeline_cost.held_bytes``)."""
    return [sum(layer_activation_bytes(layer, plan)[0] for layer in stage) for stage in stage_layers]


def held_by_rank(stages: Sequence[Sequence[Layer]], plan: Layout) -> list[float | None]:
    """Per pipeline rank of a resolved ``plan`` cut into ``stages``, the activation bytes its schedule holds at the
    peak (``pipeline_cost.held_bytes``); ``[None]`` without a pipeline (one set, ``rank_memory``'s default)."""
    if plan.pp == 1:
        return [None]
    from .pipeline_cost import held_bytes  # the schedules' module, only where a pipeline is priced

    return list(held_bytes(plan.schedule, plan.pp, plan.microbatches, plan.chunks,
                           stage_activation_bytes(stages, plan)))


def _gemm_outputs(layer: Layer, t: int) -> float:
    """Elements per sequence the weight GEMMs of ``layer`` write on one tensor-parallel rank (a column split
    writes ``n / t`` columns, a head split ``batch / t`` products; a row split writes the whole output, partial
    until it is reduced)."""
    total = 0.0
    for g in layer.gemms:
        if g.weight:
            total += g.rows * g.n * g.batch / (t if g.split in ("col", "heads") else 1)
    return total


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes on the most loaded device, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    buffers: float
    """Communication buffers, gathered ZeRO-3 units, autocast weight casts, the loss gradient."""
    capacity: float
    rank: int = 0
    """Pipeline rank the numbers are for (the one with the highest total)."""
    construction: float = 0.0
    """Peak while the model is built and loaded, before training (``construction_bytes``): the kept parameters
    plus the one full tensor in flight."""
    apart: float = 0.0
    """Bytes of the gradient and activation terms that are never live at once (``_apart``): subtracted."""
    runtime: float = 0.0
    """What the runtime itself grows by once training runs (``runtime_bytes``): 0 where not modelled."""
    step: float = 0.0
    """bf16-mixed: the fp32 gradient shard the optimizer step reads (``step_grad_bytes``), live with the model
    states after the activations are freed; 0 otherwise."""

    @property
    def training(self) -> float:
        """The training peak: the sum of the five terms and the runtime's growth, less what of them is never live
        at once (``apart``) — or the optimizer step's, if larger (model states and ``step``)."""
        backward = (self.params + self.grads + self.optimizer + self.activations + self.buffers + self.runtime
                    - self.apart)
        return max(backward, self.params + self.grads + self.optimizer + self.step + self.runtime)

    @property
    def total(self) -> float:
        """The device's peak: the larger of the training peak and the construction peak."""
        return max(self.training, self.construction)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def largest(self) -> str:
        """The largest training term, or ``construction`` when building the model is the peak."""
        if self.construction > self.training:
            return "construction"
        terms = {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                 "activations": self.activations, "buffers": self.buffers}
        return max(terms, key=lambda k: terms[k])

    def to_json(self) -> dict[str, float | int | str | bool]:
        return {"total_bytes": self.total, "params": self.params, "grads": self.grads,
                "optimizer": self.optimizer, "activations": self.activations, "buffers": self.buffers,
                "training_bytes": self.training, "construction": self.construction, "apart": self.apart,
                "runtime": self.runtime,
                "capacity_bytes": self.capacity, "largest": self.largest, "pipeline_rank": self.rank}


CPU_RUNTIME_BYTES = 24 * 2**20
"""What a CPU rank's process grows by once it trains, beyond its bare runtime (torch and shardwise imported,
``torch._dynamo`` too, the mesh made) and its tensors: kernel code and workspaces paging in on first use, thread
pools, Python's heap. Fitted: the median of peak − floor over the nine layouts of ``shardwise bench memory``'s
default GPT (4 × 256, where it dominates: 16-29 MiB); judged on the 85M and 302M GPTs' layouts (RESULTS,
"Memory down to the floor"). A GPU's caching allocator does not count it: 0 there."""


def runtime_bytes(kind: str) -> float:
    """The runtime's growth for a ``Hardware.kind`` (``cpu``: ``CPU_RUNTIME_BYTES``; else not modelled, 0)."""
    return CPU_RUNTIME_BYTES if kind == "cpu" else 0.0


def rank_memory(layers: Sequence[Layer], chunk_layers: Sequence[Sequence[Layer]], in_flight: int, plan: Layout,
                capacity: float, *, bucket_cap: float, rank: int = 0,
                parts: "RankParts | None" = None, runtime: float = 0.0, held: float | None = None) -> MemoryBreakdown:
    """Memory of one pipeline rank holding ``layers`` (its chunks' layers in ``chunk_layers``), with
    ``in_flight`` chunk activation sets held at the peak (the schedule simulator's count), and gradient buckets of
    ``bucket_cap`` bytes at most. ``parts``: ``rank_parts(layers, chunk_layers, plan)`` when the caller has it
    (they do not depend on dp, ZeRO or what is in flight: the search reuses them). ``held``: the bytes of the sets
    held at the peak where the caller knows them by chunk (``pipeline_cost.held_bytes``); else ``in_flight`` × the
    mean chunk's, exact when the rank's chunks keep the same bytes."""
    n, per_chunk, transient, biggest, loss, whole, split, experts = parts or rank_parts(layers, chunk_layers, plan)
    # ZeRO shards over every rank that holds the same parameters: dp × cp (``Layout.zero_group``); a rank's
    # routed experts over the dp × cp / ep ranks that hold the same experts (``Layout.expert_group``)
    frozen = frozen_local(layers, plan.tp, plan.ep)
    states = rank_states(n, experts, frozen, plan)
    # ZeRO-3 reads its flat ranges straight from the sources (no full tensor in flight); tensor parallelism reads
    # a row-split matrix whole before slicing it.
    sliced = 0.0 if plan.zero_stage >= 3 and plan.zero_group > 1 else split
    # Persistent gradient buffers exist from the start (ZeRO-1's, data parallelism's buckets); ZeRO-2/3 allocate
    # their shards in the first backward
    persistent = plan.zero_stage == 1 or (plan.zero_stage == 0 and plan.zero_group > 1 and plan.pp == 1)
    kept = states.params + (states.grads if persistent else 0.0)
    construction = construction_bytes(kept, in_flight=sliced, precision=plan.precision)
    activations = (in_flight * per_chunk if held is None else held) + transient
    grad_bytes = _PER_ELEMENT[plan.precision][1]
    n_grad = n - frozen  # elements with a gradient
    buffers = min(bucket_cap, n_grad * grad_bytes)  # buckets hold at most all the gradients
    if plan.precision == "bf16":
        buffers += 2 * n  # autocast's 2-byte weight casts, kept for backward
    if plan.pp > 1 and plan.zero_stage >= 2 and plan.zero_group > 1:
        # inside a pipeline the gradients are reduced once per step (shardwise train's passes before the last under
        # no_sync): the full gradients accumulate over the step's micro-batches (parallel/pipeline/grad_sync.py)
        # and become the shard at the reduction, so the step holds the full gradients, not both; ZeRO-3 also holds
        # the current and the prefetched unit gathered (parallel/pipeline/zero3.py)
        buffers += n_grad * grad_bytes - min(bucket_cap, n_grad * grad_bytes) - states.grads
        if plan.zero_stage == 3:
            buffers += 2 * biggest * (2 if plan.precision == "bf16-mixed" else 4)
    elif plan.zero_stage == 3:
        # the current and the prefetched unit's parameters, and two units' flat gradients: the one filling and the
        # one whose reduce-scatter is in flight (parallel/zero/grads.py, MAX_IN_FLIGHT = 1)
        buffers += 2 * biggest * (2 if plan.precision == "bf16-mixed" else 4) + 2 * min(biggest, n_grad) * grad_bytes
    elif plan.zero_stage == 2:
        buffers += min(bucket_cap, n_grad * grad_bytes)  # the bucket filling besides the one in flight
    return MemoryBreakdown(params=states.params, grads=states.grads, optimizer=states.optimizer,
                           activations=activations, buffers=buffers + loss, capacity=capacity, rank=rank,
                           construction=construction, apart=_apart(plan, activations, states.grads),
                           runtime=runtime, step=step_grad_bytes(states, plan.precision, plan.optimizer))


def _apart(plan: Layout, activations: float, grads: float) -> float:
    """Bytes of gradients and activations never live at once. Where the gradients are allocated in backward and
    released by the step — ZeRO-2/3 (shards) and a rank without data-parallel buckets (``param.grad`` from
    autograd) — backward frees the activations as it produces the gradients, so the two peak at opposite ends
    of it and only the larger counts. Persistent gradient buffers (data parallelism's buckets, ZeRO-1) and a
    pipeline (gradients accumulate while other micro-batches' activations wait) hold both; so does gradient
    accumulation (``grad_accum`` > 1: the first passes' gradients wait through the later passes' forwards)."""
    released = plan.zero_stage >= 2 or (plan.zero_stage == 0 and plan.zero_group == 1)
    return min(activations, grads) if released and plan.pp == 1 and plan.grad_accum <= 1 else 0.0


RankParts = tuple[float, float, float, float, float, float, float, float]
"""``(local parameters, mean activation bytes of one chunk × micro-batch, transient recomputation bytes,
largest layer's local parameters, loss bytes, largest full tensor of any layer, largest full tensor of a layer
tensor parallelism splits (0 at tp = 1), local routed-expert parameters (of the first))`` of one pipeline rank."""


def rank_parts(layers: Sequence[Layer], chunk_layers: Sequence[Sequence[Layer]], plan: Layout) -> RankParts:
    """What ``rank_memory`` needs from the layers (tp, micro-batch, recomputation, sp and precision of ``plan``)."""
    names = {layer.name for layer in layers}
    n = sum(local_params(layer, plan.tp, plan.ep) - (layer.shared / (1 if layer.replicated else plan.tp)
                                                     if layer.tied in names else 0)
            for layer in layers)
    experts = sum(expert_local(layer, plan.tp, plan.ep) for layer in layers)
    per_chunk = stage_activation_bytes(chunk_layers, plan)
    transient = max((layer_activation_bytes(layer, plan)[1] for layer in layers), default=0.0)
    biggest = max((local_params(layer, plan.tp, plan.ep) for layer in layers), default=0.0)
    loss = max((layer.act_fp32 / (1 if layer.replicated else plan.tp) * plan.micro_batch * 4 for layer in layers),
               default=0.0)
    whole = max((largest_tensor(layer) for layer in layers), default=0.0)
    split = max((largest_tensor(layer) for layer in layers if plan.tp > 1 and layer.tp_params and not layer.replicated),
                default=0.0)
    return n, sum(per_chunk) / len(per_chunk), transient, biggest, loss, whole, split, experts
