"""Reference models with no parallel code inside; strategies are applied to them from plans."""

from .gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, lm_loss, synthetic_batch
from .lora import LoRAConfig, LoRALinear
from .moe import MoE, MoESettings
from .moe_balance import step_stats, update_bias

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "lm_loss", "synthetic_batch", "MoE", "MoESettings", "LoRAConfig", "LoRALinear",
           "step_stats", "update_bias"]
