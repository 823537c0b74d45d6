"""Models with transposed and fused projections for the tensor-parallel tests: a tiny transformers GPT-2 (``Conv1D``
layers, fused [q | k | v] cut by ``split_size``), and two of our own — attention with one fused qkv
``nn.Linear`` (h -> 3h) and an MLP with one fused gate/up ``nn.Linear`` (h -> 2·inter). No parallel code inside."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def hf_gpt2(n_embd: int = 256, n_head: int = 4, layers: int = 2, vocab: int = 64):  # type: ignore[no-untyped-def]
    """A random-init ``GPT2LMHeadModel`` built from a config (no download; dropout off), or None without
    transformers."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    cfg = GPT2Config(vocab_size=vocab, n_positions=32, n_embd=n_embd, n_layer=layers, n_head=n_head,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


class FusedAttention(nn.Module):
    """Causal attention with one fused qkv projection; views by ``head_dim`` (``-1`` heads), so a rank holding
    whole heads of q, k and v runs it unchanged."""

    def __init__(self, h: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim, self.h = h // n_heads, h
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)  # 3 x (b, t, h_local)
        q, k, v = (z.reshape(b, t, -1, self.head_dim).transpose(1, 2) for z in (q, k, v))  # (b, nh_r, t, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class FusedMLP(nn.Module):
    """SwiGLU with gate and up in one ``nn.Linear`` (h -> 2·inter), cut in two after."""

    def __init__(self, h: int, inter: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(h, 2 * inter, bias=False)
        self.down = nn.Linear(inter, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 x (b, t, inter_local)
        return self.down(F.silu(gate) * up)


class FusedBlock(nn.Module):
    def __init__(self, h: int, n_heads: int, inter: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn, self.mlp = FusedAttention(h, n_heads), FusedMLP(h, inter)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class FusedLM(nn.Module):
    """Embedding, ``layers`` fused blocks, norm and an untied head."""

    def __init__(self, vocab: int = 64, h: int = 256, n_heads: int = 4, inter: int = 512, layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.blocks = nn.ModuleList(FusedBlock(h, n_heads, inter) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(h), nn.Linear(h, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))
