"""Analytic layer tables of the reference GPT and of a Llama-style decoder (see ``spec.py`` for the fields).

Everything is per sequence of ``s`` tokens; ``h`` hidden, ``a`` heads, ``hd = h/a``, ``v`` vocabulary.
Counts of memory-bound traffic and kept activations are *elements* (read + written for traffic) and say
which kernel they come from, so that a reader can check them against the model code.
"""

from __future__ import annotations

from .layers import Gemm, Layer

__all__ = ["gpt_layers", "llama_layers"]


def _attention_core(s: int, a: int, hd: int, attention: str, dropout: bool) -> tuple[tuple[Gemm, ...], float, float, int]:
    """GEMMs, extra traffic (elements, tp-split), kept elements (tp-split) and launches of ``softmax(QKᵀ)V``."""
    causal = attention == "flash"
    gemms = (Gemm("scores", s, hd, s, "heads", batch=a, weight=False, causal=causal),
             Gemm("context", s, s, hd, "heads", batch=a, weight=False, causal=causal))
    if attention == "flash":
        return gemms, 0.0, float(a * s), 0  # only the log-sum-exp per row is kept
    if attention != "unfused":
        raise ValueError(f"attention must be 'flash' or 'unfused', got {attention!r}")
    # scale-mask-softmax (read + write the a·s² scores), dropout (read, write, 1-byte mask = ½ element)
    traffic = 2.0 * a * s * s + (2.5 * a * s * s if dropout else 0.0)
    # softmax output; with dropout also its mask and output (Korthikanti Table 2: 5as²b bytes = 2.5 elements)
    kept = (2.5 if dropout else 1.0) * a * s * s
    return gemms, traffic, kept, 3 if dropout else 2


def gpt_layers(*, n_layer: int, h: int, a: int, v: int, s: int, positions: int, tie: bool, bias: bool,
               dropout: bool, attention: str) -> tuple[Layer, ...]:
    """Embedding, ``n_layer`` pre-LayerNorm blocks (qkv, attention, proj; fc, GELU, proj), final norm + head."""
    hd, sh = h // a, s * h
    mask = 2.5 * sh if dropout else 0.0  # one dropout: read, write, ½-element mask
    embed = Layer("wte", "embedding", params=v * h + positions * h, tp_params=v * h,
                  ew_rep=5.0 * sh + mask, ops=3 + int(dropout), act_rep=0.5 * sh if dropout else 0.0,
                  hidden=sh, tp_allreduces=1, largest=max(v, positions) * h)
    core, core_traffic, core_kept, core_ops = _attention_core(s, a, hd, attention, dropout)
    gemms = (Gemm("qkv", s, h, 3 * h, "col"),) + core + (
        Gemm("proj", s, h, h, "row"), Gemm("fc", s, h, 4 * h, "col"), Gemm("fc_proj", s, 4 * h, h, "row"))
    params = 12 * h * h + (13 * h if bias else 2 * h)
    block_kwargs = dict(
        params=params, tp_params=12 * h * h + (7 * h if bias else 0), gemms=gemms,
        # LayerNorm ×2 (read + write), residual add ×2 (2 reads + 1 write), two dropouts
        ew_rep=10.0 * sh + 2 * mask,
        # GELU (4h wide, read + write), the context transpose copy, the unfused softmax/dropout
        ew_tp=8.0 * sh + 2.0 * sh + core_traffic,
        ops=6 + core_ops + 2 * int(dropout),
        # kept: inputs of ln_1, qkv, ln_2, fc (+ two dropout masks)
        act_rep=4.0 * sh + (1.0 * sh if dropout else 0.0),
        # q, k, v, attention output, proj input, GELU input, fc_proj input (Korthikanti: 24/t bytes = 12 el.;
        # a flash kernel also keeps its own output)
        act_tp=(13.0 if attention == "flash" else 12.0) * sh, act_attn=core_kept, hidden=sh, tp_allreduces=2,
        largest=4 * h * h)  # fc and its projection
    blocks = [Layer(f"blocks.{i}", "block", **block_kwargs) for i in range(n_layer)]
    head = Layer("ln_f", "head", params=(2 * h if bias else h) + v * h, tp_params=v * h,
                 gemms=(Gemm("lm_head", s, h, v, "col"),), ew_rep=2.0 * sh, ew_tp=4.0 * s * v, ops=4,
                 act_rep=2.0 * sh, act_fp32=float(s * v), hidden=sh, tp_allreduces=1,
                 tied="wte" if tie else "", shared=v * h if tie else 0, largest=v * h)
    return (embed, *blocks, head)


def llama_layers(*, n_layer: int, h: int, a: int, kv: int, f: int, v: int, s: int, tie: bool,
                 attention: str) -> tuple[Layer, ...]:
    """Embedding, ``n_layer`` RMSNorm blocks (fused q/k/v with ``kv`` key/value heads, rotary, o; SwiGLU
    gate/up, down), final RMSNorm + untied head. No biases."""
    hd, sh = h // a, s * h
    kvw = kv * hd  # width of k (and of v)
    embed = Layer("embed_tokens", "embedding", params=v * h, tp_params=v * h, ew_rep=1.0 * sh, ops=1,
                  hidden=sh, tp_allreduces=1, largest=v * h)
    core, core_traffic, core_kept, core_ops = _attention_core(s, a, hd, attention, dropout=False)
    gemms = (Gemm("qkv", s, h, h + 2 * kvw, "col"),) + core + (
        Gemm("o_proj", s, h, h, "row"), Gemm("gate_up", s, h, 2 * f, "col"), Gemm("down", s, f, h, "row"))
    block_kwargs = dict(
        params=2 * h * h + 2 * h * kvw + 3 * h * f + 2 * h, tp_params=2 * h * h + 2 * h * kvw + 3 * h * f,
        gemms=gemms,
        # RMSNorm ×2 (square-mean, scale: ~3 passes of read + write), residual add ×2
        ew_rep=12.0 * sh + 6.0 * sh,
        # rotary on q and k (read + write), SiLU(gate) and its product with up (read 2f, write f, ×2 passes),
        # the context transpose copy
        ew_tp=2.0 * s * (h + kvw) + 6.0 * s * f + 2.0 * sh + core_traffic,
        ops=12 + core_ops,
        act_rep=4.0 * sh,  # inputs of both norms, of qkv, of gate_up
        act_tp=s * (h + 2 * kvw) + 2.0 * sh + 4.0 * s * f,  # q,k,v; attn out, o input; gate, up, SiLU, down input
        act_attn=core_kept, hidden=sh, tp_allreduces=2, largest=max(h * h, h * kvw, h * f))  # q/o, k/v, MLP
    blocks = [Layer(f"layers.{i}", "block", **block_kwargs) for i in range(n_layer)]
    head = Layer("norm", "head", params=h + v * h, tp_params=v * h, gemms=(Gemm("lm_head", s, h, v, "col"),),
                 ew_rep=6.0 * sh, ew_tp=4.0 * s * v, ops=6, act_rep=2.0 * sh, act_fp32=float(s * v), hidden=sh,
                 tp_allreduces=1, tied="embed_tokens" if tie else "", shared=v * h if tie else 0, largest=v * h)
    return (embed, *blocks, head)
