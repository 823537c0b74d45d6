"""Part (b) of ``shardwise bench moe``: one training step of the same MoE GPT under expert parallelism, with our
token route against transformers' (``transformers.distributed.expert_parallel.AllToAllEP``, transformers ≥ 5.2x).

Both variants are the same model on the same ranks: the reference GPT with MoE layers built from one seed, its
experts cut in ``ep`` contiguous blocks (``shard_experts``), dense parameters averaged by ``sw.DataParallel``,
expert gradients by ``ExpertGradSync``, AdamW. Only what happens between the router and the weighted sum differs:

    sw     ``parallel/expert/dispatch.route``: counts and rows through ``comm.alltoall`` (uneven splits),
           regrouped by expert, ``GroupedExperts`` (one ``F.grouped_mm`` per projection)
    hf     transformers' ``AllToAllEP`` (``torch.distributed`` functional all-to-all with autograd) around its
           ``grouped_mm`` experts forward (``Qwen3MoeExperts`` with ``_experts_implementation = "grouped_mm"``,
           the layout ours copies), holding the very same expert Parameters

The router, the shared expert, the balancing loss and everything outside the MoE layers is the same code. The
losses of the first two steps are compared (same weights, same tokens: equal up to summation order).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mesh import Mesh
from ..models.moe import MoE

__all__ = ["peer_available", "use_peer_route", "describe_peer"]


def peer_available() -> str | None:
    """None when transformers' expert parallelism can be imported, else why not (one line)."""
    try:
        import transformers.distributed.expert_parallel  # noqa: F401
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts  # noqa: F401
    except ImportError as exc:  # an older transformers has no token-dispatch expert parallelism
        return f"transformers' expert parallelism is not importable here ({exc})"
    return None


def _hf_experts(block: MoE) -> nn.Module:
    """transformers' experts module over this rank's block of ``block``'s experts (the same Parameters)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    s, w = block.settings, block.experts
    cfg = Qwen3MoeConfig(num_experts=w.gate_up_proj.size(0), hidden_size=s.hidden, moe_intermediate_size=s.ffn,
                         hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        hf = Qwen3MoeExperts(cfg)
    hf.gate_up_proj, hf.down_proj = w.gate_up_proj, w.down_proj  # shared: one optimizer, one gradient
    hf._is_expert_parallel = True  # what transformers' MoEParamShard sets on a split experts module
    return hf


def use_peer_route(model: nn.Module, mesh: Mesh, ep_axis: str, one_axis: str) -> int:
    """Route every (already sharded) MoE block of ``model`` through transformers' ``AllToAllEP`` over ``ep_axis``
    of ``mesh``; ``one_axis``: an axis of size 1 (transformers' tensor-parallel mesh: no tp here). Returns the
    number of blocks. Raises ValueError for a capacity factor (transformers' route is dropless only)."""
    from torch.distributed.device_mesh import DeviceMesh
    from transformers.distributed.expert_parallel import AllToAllEP

    ep_mesh = DeviceMesh.from_group(mesh.group(ep_axis), mesh.device.type)
    tp_mesh = DeviceMesh.from_group(mesh.group(one_axis), mesh.device.type)
    n = 0
    for module in model.modules():
        if isinstance(module, MoE):
            if module.settings.capacity_factor > 0:
                raise ValueError("the transformers route is dropless: use capacity_factor 0 in the comparison")
            dispatch = AllToAllEP(_hf_experts(module), ep_mesh, tp_mesh)
            module.routed = dispatch  # the rest of the block (router, shared expert, balancing loss) is ours
            n += 1
    return n


def describe_peer() -> dict[str, Any]:
    """Versions recorded with the results."""
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}
