"""The data-parallel side of a step as ``predict`` costs it: the gradient reduction (and ZeRO's parameter
gathers) over the ranks that hold the same parameters, exposed after what the last backward hides.

With expert parallelism (``Layout.ep > 1``, ``moe`` module doc) a rank's parameters are in two groups: the dense
ones, held by all ``dp × cp`` ranks, and its routed experts, held by the ``dp × cp / ep`` ranks of its expert
group (``tp · ep`` apart). ``dp_comm`` prices each over its own group and adds them.
"""

from __future__ import annotations

import math

from .hardware import Hardware
from .plan import Layout

__all__ = ["dp_comm", "_dp_comm"]


def dp_comm(plan: Layout, hw: Hardware, n_local: float, backward: float, forward: float, overlap: bool,
            units: int = 1, n_expert: float = 0.0, n_frozen: float = 0.0) -> float:
    """Exposed seconds per step of the gradient reduction of a rank's ``n_local`` parameter elements, of which
    ``n_expert`` are routed experts' (see module doc) and ``n_frozen`` are frozen (no gradient to reduce; ZeRO-3
    still gathers them): ``_dp_comm`` of the dense part over ``dp × cp`` plus that of the expert part over the
    expert group."""
    if plan.ep == 1 or not n_expert:
        return _dp_comm(plan, hw, n_local, backward, forward, overlap, units, n_frozen=n_frozen)
    dense = _dp_comm(plan, hw, n_local - n_expert, backward, forward, overlap, units,
                     n_frozen=n_frozen) if n_local > n_expert else 0.0
    return dense + _dp_comm(plan, hw, n_expert, backward, forward, overlap, units, expert=True)


def _dp_comm(plan: Layout, hw: Hardware, n_local: float, backward: float, forward: float, overlap: bool,
             units: int = 1, expert: bool = False, n_frozen: float = 0.0) -> float:
    """Exposed seconds per step of the gradient reduction (and ZeRO's parameter gathers) over the dp × cp
    group (``Layout.zero_group``: context-parallel ranks hold the same parameters); ``expert``: over the expert
    group of ``plan`` (``Layout.expert_group``, ranks ``tp · ep`` apart). ``n_frozen`` of the ``n_local``
    elements have no gradient: neither reduced nor (ZeRO-1/2) gathered after the step."""
    group = plan.expert_group if expert else plan.zero_group
    if group == 1:
        return 0.0
    per_node = min(group, max(1, hw.devices_per_node // (plan.tp * (plan.ep if expert else 1))))
    grad_b = 2 if plan.precision == "bf16-mixed" else 4
    param_b = 2 if plan.precision == "bf16-mixed" else 4
    # data parallelism's gradient all-reduce runs ``parallel.algorithm`` (auto: the calibration's fastest), a
    # pipeline's the backend's own; ``sw.zero`` follows ``parallel.algorithm`` too where the run has a
    # calibration for dp's group (the one predicted with), else (and ZeRO-1 inside a pipeline) runs our ring on
    # a CPU host (gloo's own reduce-scatter is 2-3x slower there) and the backend's collectives on GPUs
    if plan.zero_stage == 0:
        algorithm = "native" if plan.pp > 1 else "auto"
    elif plan.pp == 1 and group in hw.collectives and not expert:
        algorithm = "auto"  # sw.zero follows parallel.algorithm = auto where the run has this calibration
    else:
        algorithm = "ring" if hw.host_cores else "native"
    coll = lambda op, nbytes: hw.collective_time(op, nbytes, group, per_node=per_node,  # noqa: E731
                                                 algorithm=algorithm)
    # plain data parallelism all-reduces the gradients; every ZeRO stage reduce-scatters them (each replica
    # keeps the averaged shard it updates) and stages 1-2 all-gather the updated parameters after the step
    n_grad = max(0.0, n_local - n_frozen)
    reduce = coll("all_reduce" if plan.zero_stage == 0 else "reduce_scatter", n_grad * grad_b)
    gather = coll("all_gather", n_grad * param_b) if plan.zero_stage in (1, 2) else 0.0
    # On a CPU host (a calibration with host_cores) gloo moves the bytes with the same cores the ranks compute
    # on: communication takes its time from compute instead of hiding under it. Every ZeRO stage reduces its
    # buckets during backward, as data parallelism does (a pipeline's ZeRO-1 per stage as its backward ends).
    overlap = overlap and not hw.host_cores
    if plan.zero_stage == 3 and plan.pp > 1:
        return _pipeline_zero3(plan, hw, coll, n_local * param_b, n_grad * grad_b, backward, forward, overlap, units)
    if plan.zero_stage == 3:
        # every pass gathers each unit's parameters for forward and again for backward (prefetch hides what
        # compute covers), and reduce-scatters its gradients during backward; each of these 3 collectives per
        # unit blocks until the slowest replica joins
        passes = plan.grad_accum
        # one collective per unit, each paying its own latency: at a thousand ranks a ring's (P - 1) steps cost
        # milliseconds per call, whatever the bytes
        fwd = units * coll("all_gather", n_local * param_b / units)
        reduce = units * coll("reduce_scatter", n_grad * grad_b / units)
        waits = 3 * units * hw.sync_skew_s
        if not overlap:
            return passes * (2 * fwd + reduce + waits)
        exposed_f = max(fwd - forward, fwd / 8)
        exposed_b = max(fwd + reduce - backward, (fwd + reduce) / 8)
        return passes * (exposed_f + exposed_b + waits)
    reduce += hw.sync_skew_s  # the reduction waits for the slowest replica
    if not overlap:
        return reduce + gather
    # buckets start during the last pass's backward; the last bucket (1/8 at least) cannot overlap
    return max(reduce - backward, reduce / 8) + gather


def _pipeline_zero3(plan: Layout, hw: Hardware, coll, param_bytes: float, grad_bytes: float, backward: float,
                    forward: float, overlap: bool, units: int) -> float:
    """ZeRO-3 inside a pipeline (``parallel/pipeline/zero3.py``): every micro-batch gathers each unit for its
    forward and again for its backward (``2m`` all-gathers per unit and flush), the gradients are reduce-scattered
    once per flush as the stage's last backward ends. ``forward``/``backward``: one micro-batch's on the rank, what
    a prefetched gather can hide behind; unbounded (the search's lower bounds) — priced at the least count of
    micro-batches, 1, so the bound holds for every count and is shared by every candidate of a group."""
    m = max(1, plan.microbatches) if math.isfinite(forward) else 1
    gather = units * coll("all_gather", param_bytes / units)
    reduce = units * coll("reduce_scatter", grad_bytes / units)
    waits = (2 * m + 1) * units * hw.sync_skew_s
    if not overlap:
        return plan.grad_accum * (2 * m * gather + reduce + waits)
    exposed = m * (max(gather - forward, gather / 8) + max(gather - backward, gather / 8))
    return plan.grad_accum * (exposed + max(reduce - backward, reduce / 8) + waits)
