"""Analytic layer tables of mixture-of-experts blocks and of the attention variants of recent decoders (see
``spec.py`` for the fields, ``builders.py`` for the dense GPT and Llama tables these extend).

Everything is per sequence of ``s`` tokens, in elements. A **part** is a dict of ``Layer`` field contributions
(``params``, ``gemms``, ``act_tp`` …); a block is the sum of its parts (``block``), and an MoE block of the GPT or
Llama tables is their dense block with the MLP part taken out and the MoE part put in (``swap_mlp``), so that a
dense model's table is exactly what ``builders.py`` makes.

The MoE part (``moe_part``), per sequence of ``s`` tokens, ``E`` routed experts of width ``f`` (SwiGLU:
``gate_up`` h×2f, ``down`` f×h), ``top_k = k``:

* the router GEMM ``s × h × E`` (replicated over tensor parallelism, as Megatron-Core keeps it), its softmax /
  sigmoid and top-k (``4·s·E`` elements of traffic);
* the permutation of the tokens into expert order and back (``s·h·(1 + k)`` each way): ``s·k`` rows leave;
* the experts as two grouped GEMMs of ``s·k`` rows spread over ``E`` experts (``Gemm.experts``), their SwiGLU
  (``6·s·k·f``), and the shared experts as an ordinary SwiGLU of width ``fs`` (every token);
* kept for backward: the permuted tokens and the expert outputs (``2·s·k·h``, the weighted combine needs
  both), the router's scores (``s·E``), gate, up, their product and down's input per routed row (``4·s·k·f``);
* ``expert_params = E·3·h·f`` (+ biases), ``inactive = (E - k)/E`` of them, ``a2a = s·k·h``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .layers import Gemm, Layer

__all__ = ["moe_part", "swiglu_part", "gqa_part", "mla_part", "block", "swap_mlp", "is_moe_layer", "gpt_mlp_part",
           "llama_mlp_part", "window_keys"]

_SUMMED = ("params", "tp_params", "ew_rep", "ew_tp", "ops", "act_rep", "act_tp", "act_attn", "expert_params",
           "inactive", "a2a")


def is_moe_layer(i: int, n_experts: int, first_dense: int, every: int) -> bool:
    """Whether block ``i`` (0-based) is an MoE block: experts on, past the first dense ones, every ``every``-th
    (the rule of ``shardwise.models.moe.moe_layer``)."""
    return n_experts > 0 and i >= first_dense and (i - first_dense) % max(every, 1) == 0


def moe_part(*, s: int, h: int, n_experts: int, top_k: int, ffn: int, shared_ffn: int = 0, shared_gate: bool = False,
             router_bias: bool = False, expert_bias: bool = False, imbalance: float = 1.0) -> dict[str, Any]:
    """The MoE block's contributions (module doc); ``expert_bias``: each expert's ``gate_up`` and ``down`` carry
    biases (gpt-oss), ``router_bias``: the router's logits do."""
    E, k, f, fs = n_experts, top_k, ffn, shared_ffn
    rows = s * k
    per_expert = 3 * h * f + ((2 * f + h) if expert_bias else 0)
    experts = E * per_expert
    gemms = [Gemm("router", s, h, E), Gemm("experts.gate_up", rows, h, 2 * f, "col", experts=E),
             Gemm("experts.down", rows, f, h, "row", experts=E)]
    shared = 3 * h * fs
    if fs:
        gemms += [Gemm("shared.gate_up", s, h, 2 * fs, "col"), Gemm("shared.down", s, fs, h, "row")]
    if fs and shared_gate:
        gemms.append(Gemm("shared.gate", s, h, 1))
    router = h * E + (E if router_bias else 0)
    return dict(
        params=router + experts + shared + (h if fs and shared_gate else 0), tp_params=experts + shared,
        gemms=tuple(gemms),
        # scores (fp32 logits: softmax or sigmoid, top-k, gather of the chosen weights); the permutation into
        # expert order and back (read s·h, write s·k·h; read s·k·h and the weights, write s·h)
        ew_rep=4.0 * s * E + 2.0 * s * h * (1 + k) + s * k,
        ew_tp=6.0 * rows * f + 6.0 * s * fs + (2.0 * s * h if fs and shared_gate else 0.0),  # SwiGLUs
        ops=8 + 2 + (2 if fs else 0),
        act_rep=2.0 * rows * h + s * E, act_tp=4.0 * rows * f + 4.0 * s * fs,
        expert_params=experts, inactive=(E - k) * per_expert, a2a=float(rows * h), imbalance=imbalance,
        largest=max(E * 2 * f * h, h * fs))


def swiglu_part(*, s: int, h: int, ffn: int, bias: bool = False) -> dict[str, Any]:
    """A dense SwiGLU MLP of width ``ffn`` (``gate_up`` h×2f column-split, ``down`` f×h row-split)."""
    f = ffn
    return dict(params=3 * h * f + ((2 * f + h) if bias else 0), tp_params=3 * h * f + (2 * f if bias else 0),
                gemms=(Gemm("gate_up", s, h, 2 * f, "col"), Gemm("down", s, f, h, "row")),
                ew_tp=6.0 * s * f, ops=2, act_tp=4.0 * s * f, largest=h * f)


def gpt_mlp_part(*, s: int, h: int, bias: bool) -> dict[str, Any]:
    """The reference GPT's MLP as ``builders.gpt_layers`` counts it (fc 4h, GELU, fc_proj)."""
    return dict(params=8 * h * h + (5 * h if bias else 0), tp_params=8 * h * h + (4 * h if bias else 0),
                gemms=("fc", "fc_proj"), ew_tp=8.0 * s * h, ops=1, act_tp=8.0 * s * h)


def llama_mlp_part(*, s: int, h: int, ffn: int) -> dict[str, Any]:
    """The Llama table's SwiGLU MLP as ``builders.llama_layers`` counts it (to take out of its block)."""
    return dict(params=3 * h * ffn, tp_params=3 * h * ffn, gemms=("gate_up", "down"), ew_tp=6.0 * s * ffn,
                ops=2, act_tp=4.0 * s * ffn)


def swap_mlp(layer: Layer, dense: dict[str, Any], moe: dict[str, Any]) -> Layer:
    """``layer`` (a dense block) with its MLP part ``dense`` (its GEMMs by name) replaced by the part ``moe``."""
    fields: dict[str, Any] = {}
    for name in _SUMMED:
        value = getattr(layer, name) - dense.get(name, 0) + moe.get(name, 0)
        fields[name] = type(getattr(layer, name))(value)
    gemms = tuple(g for g in layer.gemms if g.name not in dense["gemms"]) + tuple(moe["gemms"])
    return replace(layer, gemms=gemms, largest=max(layer.largest, moe.get("largest", 0)),
                   imbalance=moe.get("imbalance", 1.0), **fields)


def block(name: str, *parts: dict[str, Any], **extra: Any) -> Layer:
    """A ``block`` layer: the sum of ``parts`` (and ``extra`` fields: ``hidden``, ``tp_allreduces`` …)."""
    fields: dict[str, Any] = {key: 0 for key in _SUMMED}
    gemms: list[Gemm] = []
    largest, imbalance = 0, 1.0
    for part in parts:
        for key in _SUMMED:
            fields[key] += part.get(key, 0)
        gemms += list(part.get("gemms", ()))
        largest = max(largest, part.get("largest", 0))
        imbalance = max(imbalance, part.get("imbalance", 1.0))
    for key in ("ew_rep", "ew_tp", "act_rep", "act_tp", "act_attn", "a2a"):
        fields[key] = float(fields[key])
    fields.update(extra)
    return Layer(name, "block", gemms=tuple(gemms), largest=largest, imbalance=imbalance, **fields)


def window_keys(s: int, window: int) -> int:
    """Keys a query sees on average under causal sliding-window attention of ``window`` keys (0: none):
    ``window - window²/(2s)`` for ``window < s`` (the first ``window`` queries see fewer)."""
    if not window or window >= s:
        return 0
    return max(1, round(window - window * window / (2 * s)))


def _core(s: int, a: int, qk: int, v: int, window: int, attention: str) -> tuple[tuple[Gemm, ...], float, float, int]:
    """The attention core of ``a`` heads (query/key width ``qk``, value width ``v``): GEMMs, traffic, kept, ops.
    A sliding window prices ``window_keys`` keys per query (not causal-halved: the band is already counted)."""
    keys = window_keys(s, window)
    causal = attention == "flash" and not keys
    n = keys or s
    gemms = (Gemm("scores", s, qk, n, "heads", batch=a, weight=False, causal=causal),
             Gemm("context", s, n, v, "heads", batch=a, weight=False, causal=causal))
    if attention == "flash":
        return gemms, 0.0, float(a * s), 0
    if attention != "unfused":
        raise ValueError(f"attention must be 'flash' or 'unfused', got {attention!r}")
    return gemms, 2.0 * a * s * n, float(a * s * n), 2


def gqa_part(*, s: int, h: int, heads: int, kv_heads: int, head_dim: int, attention: str, window: int = 0,
             qkv_bias: bool = False, o_bias: bool = False, sinks: bool = False, qk_norm: bool = False) -> dict[str, Any]:
    """Grouped-query attention with ``head_dim`` (q width ``heads·head_dim``, which may differ from ``h``), rotary,
    optional biases, learned attention sinks (one logit per head), per-head q/k RMSNorm (Qwen3)."""
    qw, kvw = heads * head_dim, kv_heads * head_dim
    core, traffic, kept, core_ops = _core(s, heads, head_dim, head_dim, window, attention)
    bias = (qw + 2 * kvw if qkv_bias else 0)
    params = h * (qw + 2 * kvw) + qw * h + bias + (h if o_bias else 0) + (heads if sinks else 0)
    params += 2 * head_dim if qk_norm else 0
    return dict(params=params, tp_params=h * (qw + 2 * kvw) + qw * h + bias + (heads if sinks else 0),
                gemms=(Gemm("qkv", s, h, qw + 2 * kvw, "col"),) + core + (Gemm("o_proj", s, qw, h, "row"),),
                # rotary on q and k, the context transpose copy, per-head norms (read + write)
                ew_tp=2.0 * s * (qw + kvw) + 2.0 * s * qw + traffic + (6.0 * s * (qw + kvw) if qk_norm else 0.0),
                ops=8 + core_ops + (4 if qk_norm else 0), act_tp=s * (qw + 2 * kvw) + 2.0 * s * qw, act_attn=kept,
                largest=max(h * qw, h * kvw))


def mla_part(*, s: int, h: int, heads: int, q_lora: int, kv_lora: int, nope: int, rope: int, v_dim: int,
             attention: str) -> dict[str, Any]:
    """Multi-head latent attention (DeepSeek-V2/V3): q through a rank-``q_lora`` bottleneck (0: one projection),
    keys and values from a rank-``kv_lora`` latent plus a shared rotary key of width ``rope``; per head query /
    key width ``nope + rope``, value width ``v_dim``. The down-projections are replicated over tensor
    parallelism (their outputs are small), the up-projections and ``o_proj`` split by heads."""
    a, qk = heads, nope + rope
    core, traffic, kept, core_ops = _core(s, a, qk, v_dim, 0, attention)
    q = ((Gemm("q_a", s, h, q_lora), Gemm("q_b", s, q_lora, a * qk, "col")) if q_lora
         else (Gemm("q_proj", s, h, a * qk, "col"),))
    split = (q_lora * a * qk if q_lora else h * a * qk) + kv_lora * a * (nope + v_dim) + a * v_dim * h
    whole = (h * q_lora + q_lora if q_lora else 0) + h * (kv_lora + rope) + kv_lora
    gemms = q + (Gemm("kv_a", s, h, kv_lora + rope), Gemm("kv_b", s, kv_lora, a * (nope + v_dim), "col")) + core + (
        Gemm("o_proj", s, a * v_dim, h, "row"),)
    return dict(params=split + whole, tp_params=split, gemms=gemms,
                # the latents' RMSNorms (3 passes of read + write), the shared rotary key
                ew_rep=6.0 * s * (q_lora + kv_lora) + 2.0 * s * rope,
                # rotary on the query's rope part, q/k assembled from their parts (copies), the context transpose
                ew_tp=2.0 * s * a * rope + 4.0 * s * a * qk + 2.0 * s * a * v_dim + traffic, ops=14 + core_ops,
                act_rep=s * (2.0 * q_lora + 2.0 * kv_lora + rope),
                act_tp=2.0 * s * a * qk + 3.0 * s * a * v_dim + s * a * (nope + v_dim), act_attn=kept,
                largest=max(kv_lora * a * (nope + v_dim), a * v_dim * h, (q_lora or h) * a * qk))
