"""Expert parallelism as the planner costs it: what ``Layout.ep`` changes in a mixture of experts' step.

``ep`` is folded into the ``dp × cp`` ranks (the mesh ``(pp, dp, cp, tp)``, ep the innermost ``ep`` of the
flattened ``dp × cp``): an ep group is ``ep`` ranks ``tp`` apart, inside a node when ``tp · ep ≤
devices_per_node``. Each of its ranks holds ``E/ep`` of every MoE layer's routed experts (and ``1/ep`` of their
parameters, gradients and optimizer state); the ranks of one ep group exchange their tokens so that each
expert sees every token routed to it:

* **all-to-all** (``a2a_time``): per MoE layer two in forward (dispatch to the experts, combine back) and two
  in backward, each moving ``tokens · top_k · h · dtype · (ep − 1)/ep`` bytes out of (and into) every rank
  (``a2a_bytes``); priced with the hardware's links as its other collectives are: the bytes for peers on the
  rank's node through the intra-node link, the rest through the device's NIC share, concurrently, plus one
  link latency per peer and the sync skew. Not overlapped with compute (Megatron-Core's default dispatcher). With
  ``tp > 1`` each tensor-parallel rank dispatches ``1/tp`` of the tokens (the sequence-parallel split).
  Full recomputation runs the forward's two again in backward.
* **expert compute** per rank is its ``ep`` share: ``E/ep`` experts with ``ep`` times the rows each (the same
  FLOPs as ``ep = 1``, larger GEMMs; ``compute._shape``).
* **imbalance** (``Layer.imbalance``, ``ModelSpec`` argument ``moe_imbalance``, default 1.0 = an ideal balance):
  the most loaded ep rank receives ``imbalance ×`` the mean routed tokens and every rank waits for it, so the
  expert GEMMs and the all-to-alls of ``ep > 1`` are scaled by it. Measured routers stay within ~1.1-1.3 of the
  mean with balancing losses; 1.0 is the planner's optimistic default, stated wherever it is printed.
* **memory**: the routed experts' parameters, gradients and optimizer state ``/ ep``; under ZeRO they are
  sharded over the ``dp·cp/ep`` ranks that hold the same experts (``Layout.expert_group``), the dense parts as
  before over ``dp·cp``.
* **gradients**: the experts' averaged over the ``dp·cp/ep`` ranks that hold them (``ep·tp`` apart), the dense
  parameters' over ``dp·cp`` (``dp_comm``).
"""

from __future__ import annotations

from typing import Any

from .hardware import Hardware
from .layers import Layer
from .plan import Layout

__all__ = ["a2a_bytes", "a2a_time", "ep_per_node", "expert_per_node", "moe_comm", "check_ep", "expert_local",
           "optimizer_elements"]


def a2a_bytes(tokens: float, top_k: int, hidden: int, elem_bytes: int, ep: int) -> float:
    """Bytes one rank sends (and receives) in one all-to-all of ``tokens`` tokens each routed to ``top_k``
    experts: ``tokens · top_k · hidden · elem_bytes · (ep − 1)/ep`` (the ``1/ep`` routed to its own experts stay)."""
    return tokens * top_k * hidden * elem_bytes * (ep - 1) / ep


def ep_per_node(plan: Layout, hw: Hardware) -> int:
    """Ranks of one ep group on a node (they are ``tp`` apart)."""
    return min(plan.ep, max(1, hw.devices_per_node // plan.tp))


def expert_per_node(plan: Layout, hw: Hardware) -> int:
    """Ranks of one expert-data-parallel group (``dp·cp/ep`` ranks ``tp·ep`` apart) on a node."""
    return min(plan.expert_group, max(1, hw.devices_per_node // (plan.tp * plan.ep)))


def a2a_time(hw: Hardware, buffer_bytes: float, size: int, per_node: int) -> float:
    """Seconds of one all-to-all over ``size`` ranks (``per_node`` of them per node) in which every rank holds
    ``buffer_bytes`` spread evenly over the ``size`` destinations (module doc)."""
    if size <= 1 or buffer_bytes <= 0:
        return 0.0
    near = min(per_node, size)
    local = buffer_bytes * (near - 1) / size
    remote = buffer_bytes * (size - near) / size
    seconds = local / hw.intra.bus_bandwidth_Bps
    if remote > 0:
        seconds = max(seconds, remote / hw.inter.bus_bandwidth_Bps)
    # one link latency per peer: gloo's all-to-all of a few bytes on 4 CPU ranks took 3 of the calibration's
    # latencies (benchmarks/planner_moe_published.py --a2a-check)
    latency = (near - 1) * hw.intra.alpha_s + (size - near) * hw.inter.alpha_s
    return seconds + latency + hw.sync_skew_s


def moe_comm(layer: Layer, plan: Layout, hw: Hardware, elem_bytes: int) -> tuple[float, float]:
    """``(forward, backward)`` seconds of ``layer``'s expert-parallel all-to-alls for one micro-batch (module
    doc); ``(0, 0)`` at ep = 1 or for a layer without routed experts."""
    if plan.ep == 1 or not layer.a2a:
        return 0.0, 0.0
    buffer = layer.a2a * plan.micro_batch * elem_bytes / plan.tp * layer.imbalance
    one = a2a_time(hw, buffer, plan.ep, ep_per_node(plan, hw))
    fwd = 2 * one
    bwd = 2 * one + (fwd if plan.activation_checkpointing == "full" and layer.kind == "block" else 0.0)
    return fwd, bwd


def check_ep(spec: Any, plan: Layout) -> None:
    """``ValueError`` when ``plan.ep`` cannot split ``spec``'s experts."""
    if plan.ep == 1:
        return
    experts = spec.n_experts
    if not experts:
        raise ValueError(f"ep = {plan.ep}: model {spec.name!r} has no routed experts to split; use ep = 1")
    if experts % plan.ep:
        raise ValueError(f"ep = {plan.ep} must divide the model's {experts} experts; use an ep among "
                         f"{[d for d in range(1, experts + 1) if experts % d == 0 and (plan.dp * plan.cp) % d == 0]}")


def expert_local(layer: Layer, tp: int, ep: int) -> float:
    """Routed-expert parameter elements of ``layer`` on one rank (tensor and expert parallel)."""
    if not layer.expert_params:
        return 0.0
    return layer.expert_params / ((1 if layer.replicated else tp) * ep)


def optimizer_elements(plan: Layout, n_local: float, n_expert: float) -> float:
    """What ``step_extras.optimizer_time`` divides by the ZeRO group so that a rank updates its dense shard
    (``/ dp·cp``) and its experts' shard (``/ dp·cp/ep``): ``n_local`` with the expert part ``× ep`` under ZeRO."""
    if plan.zero_stage >= 1 and plan.ep > 1:
        return n_local + (plan.ep - 1) * n_expert
    return n_local
