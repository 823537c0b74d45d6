"""Small models for the ``sw.auto`` tests (unit and dist): a Llama-style decoder, a classifier with a huge head,
and a small MLP. No parallel code inside; sizes chosen so each case's answer is clear-cut under the default
(nominal) cost model."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """q/k/v/o as separate Linears, grouped-query heads; reshapes by ``head_dim`` (``-1`` heads), so whole
    heads per rank work unchanged."""

    def __init__(self, h: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.head_dim = h // n_heads
        self.q_proj = nn.Linear(h, n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(n_heads * self.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        groups = q.size(1) // k.size(1)  # (b, nh_local, t, hd) vs (b, nkv_local, t, hd)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, inter, bias=False), nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, h: int, n_heads: int, n_kv_heads: int, inter: int) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(h), RMSNorm(h)
        self.self_attn, self.mlp = Attention(h, n_heads, n_kv_heads), MLP(h, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 64, h: int = 512, n_heads: int = 8, n_kv_heads: int = 4, inter: int = 1024,
                 n_layers: int = 2) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, n_heads, n_kv_heads, inter) for _ in range(n_layers))
        self.norm, self.lm_head = RMSNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class Classifier(nn.Module):
    """A small backbone (16 -> 32 -> 32) and a huge head (32 -> ``classes``): OneFlow's partial-FC case."""

    def __init__(self, classes: int = 20000, d_in: int = 16, width: int = 32) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                      nn.LayerNorm(width))
        self.head = nn.Linear(width, classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


class SmallMLP(nn.Module):
    """Few weights, many tokens: splitting weights buys little compute and costs an all-reduce per pair."""

    def __init__(self, d: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


MEGATRON = {"column": ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"), "row": ("o_proj", "down_proj")}
"""Megatron-LM's pairing by projection name."""


def hf_llama(layers: int = 2):  # type: ignore[no-untyped-def]
    """A small transformers ``LlamaForCausalLM`` built from a config (no download), or None without transformers."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    cfg = LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


class WideInput(nn.Module):
    """Its first layer reads the raw input (4096 features) and shrinks it to 16: ``sw.auto`` must not split it by
    row (nothing splits the input's features), which its price alone would favour under a memory budget."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4096, 16)
        self.up = nn.Linear(16, 256)
        self.down = nn.Linear(256, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(torch.relu(self.inp(x)))))
