"""Reference models with no parallel code inside; strategies are applied to them from plans."""

from .gpt import GPT, MLP, Block, CausalSelfAttention, GPTConfig, lm_loss, synthetic_batch

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "lm_loss", "synthetic_batch"]
