"""The mixture-of-experts pieces of the Llama-family decoder (Mixtral, Qwen2-MoE, Qwen3-MoE): the MoE block of a
layer built from the Hugging Face config, its initial values, and its tensor-parallel plan.

The block is ``shardwise.models.moe.MoE`` with a softmax router whose top-k weights are renormalised as the
config says (``norm_topk_prob``; Mixtral always), the expert width ``moe_intermediate_size`` (Mixtral: its
``intermediate_size``), Qwen2-MoE's shared expert gated by ``sigmoid(shared_expert_gate(x))``, and the balancing
loss weighted by ``router_aux_loss_coef``. That loss is ``moe_balance``'s per-sequence one (1 when balanced),
not transformers' batch-wide one (``top_k`` when balanced, summed over the layers' statistics before the product):
the logits are the same, the auxiliary term of the training loss is not.
"""

from __future__ import annotations

from torch import nn

from ..parallel.common.init_rules import InitRule
from ..parallel.expert.style import ExpertParallel
from ..parallel.tensor.styles import ColumnParallel, RowParallel, Style
from .hf_config import HFDecoderConfig
from .moe import MoE, MoESettings, moe_init_rule

__all__ = ["moe_settings", "moe_block", "moe_param_init", "feed_forward_plan"]


def moe_settings(c: HFDecoderConfig) -> MoESettings:
    """The MoE block of an MoE layer of ``c`` (``c.num_experts`` > 0). Pure."""
    shared = c.shared_expert_intermediate_size
    return MoESettings(n_experts=c.num_experts, top_k=c.num_experts_per_tok, hidden=c.hidden_size,
                       ffn=c.moe_intermediate_size, shared_ffn=shared, shared_gate=shared > 0, router="softmax",
                       renorm=c.norm_topk_prob, aux_coef=c.router_aux_loss_coef)


def moe_block(c: HFDecoderConfig) -> MoE:
    return MoE(moe_settings(c))


def moe_param_init(module: nn.Module, attr: str, std: float) -> InitRule | None:
    """The router and the experts' 3-D weights start N(0, ``std``) as transformers' ``_init_weights`` draws them
    (the values differ: a rule's draws are a function of the element, whatever the layout); None otherwise."""
    return moe_init_rule(module, attr, std, std)


def feed_forward_plan(c: HFDecoderConfig, split_experts: bool = True) -> dict[str, Style]:
    """The tensor-parallel styles of the feed-forward parts: dense layers' gate/up column-parallel and down
    row-parallel (only when the model has dense layers: a pattern must match a module); MoE layers' experts
    ``ExpertParallel`` over the tp axis (each rank runs its ``E / tp`` experts on the tokens every tp rank holds,
    the outputs summed) unless ``split_experts`` is false (expert parallelism over the data-parallel ranks
    already holds a block of them: they stay whole on tp, each tp rank routing the same tokens), and the shared
    expert column/row-parallel like a dense MLP. The router and the shared expert's gate stay replicated."""
    layers = range(c.num_hidden_layers)
    plan: dict[str, Style] = {}
    if any(not c.is_moe_layer(i) for i in layers):
        plan.update({"model.layers.*.mlp.gate_proj": ColumnParallel(), "model.layers.*.mlp.up_proj": ColumnParallel(),
                     "model.layers.*.mlp.down_proj": RowParallel()})
    if any(c.is_moe_layer(i) for i in layers):
        if split_experts:
            plan["model.layers.*.mlp.experts"] = ExpertParallel()  # type: ignore[assignment]
        if c.shared_expert_intermediate_size:
            plan.update({"model.layers.*.mlp.shared_expert.gate_proj": ColumnParallel(),
                         "model.layers.*.mlp.shared_expert.up_proj": ColumnParallel(),
                         "model.layers.*.mlp.shared_expert.down_proj": RowParallel()})
    return plan
