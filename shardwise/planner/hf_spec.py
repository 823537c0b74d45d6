"""The planner's layer table of a Hugging Face decoder, read from its ``config.json`` dict (pure: no
``transformers``, no torch): dense Llama-like decoders and the mixtures of experts ``mixtral``, ``qwen2_moe``,
``qwen3_moe``, ``gpt_oss`` and ``deepseek_v3`` (``ModelSpec.from_hf``).

What each reads (``read_hf``; a missing key takes transformers' default):

* all: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
  (default hidden / heads), ``vocab_size``, ``tie_word_embeddings``, ``intermediate_size`` (the dense MLP's
  width), ``sliding_window`` with ``layer_types`` (``sliding_attention`` layers attend to ``sliding_window``
  keys: priced over ``min(seq, window)`` keys, ``moe_builders.window_keys``);
* ``mixtral``: ``num_local_experts``, ``num_experts_per_tok``; ``intermediate_size`` is the expert width;
* ``qwen2_moe`` / ``qwen3_moe``: ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
  ``decoder_sparse_step`` (layer ``i`` is MoE when ``(i + 1) % step == 0``) and ``mlp_only_layers``; Qwen2-MoE
  also ``shared_expert_intermediate_size`` (with its sigmoid gate) and q/k/v biases, Qwen3-MoE per-head q/k norms;
* ``gpt_oss``: experts as mixtral, with biases, a router bias, attention biases and one learned sink per head;
* ``deepseek_v3``: multi-head latent attention (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim``, ``v_head_dim``), ``n_routed_experts``, ``n_shared_experts``, ``moe_intermediate_size``,
  ``first_k_dense_replace``, ``moe_layer_freq``. The multi-token-prediction layers are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .layers import Gemm, Layer
from .moe_builders import block, gqa_part, is_moe_layer, mla_part, moe_part, swiglu_part

__all__ = ["HFShape", "read_hf", "hf_layers", "tp_divisors", "MOE_TYPES"]

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3")


@dataclass(frozen=True)
class HFShape:
    """What the planner needs of an HF decoder config (plain data)."""

    model_type: str
    n_layer: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int
    tie: bool = False
    windows: tuple[int, ...] = ()
    """Per layer: the sliding window (0: full attention)."""
    moe: tuple[bool, ...] = ()
    """Per layer: an MoE block (else the dense SwiGLU of width ``ffn``)."""
    n_experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    shared_gate: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    qk_norm: bool = False
    mla: dict[str, int] = field(default_factory=dict)
    """``q_lora``, ``kv_lora``, ``nope``, ``rope``, ``v_dim`` for multi-head latent attention; empty: GQA."""


def _int(cfg: Mapping[str, Any], key: str, default: int = 0) -> int:
    value = cfg.get(key)
    return default if value is None else int(value)


def _moe_fields(cfg: Mapping[str, Any], kind: str, n: int) -> dict[str, Any]:
    """The MoE fields of a config of ``model_type`` ``kind`` (module doc)."""
    if kind in ("mixtral", "gpt_oss"):
        E = _int(cfg, "num_local_experts", 8 if kind == "mixtral" else 128)
        out = dict(n_experts=E, top_k=_int(cfg, "num_experts_per_tok", 2 if kind == "mixtral" else 4),
                   moe_ffn=_int(cfg, "intermediate_size"), moe=(True,) * n)
        if kind == "gpt_oss":
            out.update(expert_bias=True, router_bias=True)
        return out
    if kind in ("qwen2_moe", "qwen3_moe"):
        E = _int(cfg, "num_experts", _int(cfg, "num_local_experts"))
        step, dense_only = max(1, _int(cfg, "decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or ())
        moe = tuple(E > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n))
        shared = _int(cfg, "shared_expert_intermediate_size") if kind == "qwen2_moe" else 0
        return dict(n_experts=E, top_k=_int(cfg, "num_experts_per_tok"), moe_ffn=_int(cfg, "moe_intermediate_size"),
                    shared_ffn=shared, shared_gate=bool(shared), moe=moe)
    if kind == "deepseek_v3":
        E, f = _int(cfg, "n_routed_experts", _int(cfg, "num_local_experts")), _int(cfg, "moe_intermediate_size")
        moe = tuple(is_moe_layer(i, E, _int(cfg, "first_k_dense_replace"), _int(cfg, "moe_layer_freq", 1))
                    for i in range(n))
        return dict(n_experts=E, top_k=_int(cfg, "num_experts_per_tok"), moe_ffn=f,
                    shared_ffn=_int(cfg, "n_shared_experts") * f, moe=moe)
    return dict(moe=(False,) * n)


def read_hf(cfg: Mapping[str, Any]) -> HFShape:
    """The ``HFShape`` of a ``config.json`` dict; ``ValueError`` naming a missing or bad size."""
    kind = str(cfg.get("model_type", "llama"))
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] < 1:
            raise ValueError(f"HF config ({kind}) needs a positive int {key}, got {cfg.get(key)!r}")
    n, h, a = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    window = _int(cfg, "sliding_window")
    types = list(cfg.get("layer_types") or [])
    if kind in ("qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = 0  # Qwen's sliding_window is off unless use_sliding_window
    if types and len(types) == n:
        windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    else:
        windows = (window,) * n
    fields_ = dict(model_type=kind, n_layer=n, hidden=h, heads=a, kv_heads=_int(cfg, "num_key_value_heads", a),
                   head_dim=_int(cfg, "head_dim", h // a), vocab=cfg["vocab_size"], ffn=_int(cfg, "intermediate_size"),
                   tie=bool(cfg.get("tie_word_embeddings", False)), windows=windows)
    fields_.update(_moe_fields(cfg, kind, n))
    if kind == "qwen2_moe":
        fields_.update(qkv_bias=bool(cfg.get("qkv_bias", True)))
    elif kind == "qwen3_moe":
        fields_.update(qk_norm=True, qkv_bias=bool(cfg.get("attention_bias", False)),
                       o_bias=bool(cfg.get("attention_bias", False)))
    elif kind == "gpt_oss":
        fields_.update(qkv_bias=bool(cfg.get("attention_bias", True)), o_bias=bool(cfg.get("attention_bias", True)),
                       sinks=True)
    elif kind == "deepseek_v3":
        fields_.update(mla=dict(q_lora=_int(cfg, "q_lora_rank"), kv_lora=_int(cfg, "kv_lora_rank", 512),
                                nope=_int(cfg, "qk_nope_head_dim", 128), rope=_int(cfg, "qk_rope_head_dim", 64),
                                v_dim=_int(cfg, "v_head_dim", 128)), kv_heads=a)
    elif cfg.get("attention_bias"):
        fields_.update(qkv_bias=True, o_bias=True)
    shape = HFShape(**fields_)
    if any(shape.moe) and (shape.top_k < 1 or shape.moe_ffn < 1 or shape.top_k > shape.n_experts):
        raise ValueError(f"HF config ({kind}): an MoE needs 1 <= num_experts_per_tok <= experts and a positive expert "
                         f"width, got top_k {shape.top_k}, experts {shape.n_experts}, width {shape.moe_ffn}")
    return shape


def _attention(shape: HFShape, s: int, window: int, attention: str) -> dict[str, Any]:
    if shape.mla:
        return mla_part(s=s, h=shape.hidden, heads=shape.heads, attention=attention, **shape.mla)
    return gqa_part(s=s, h=shape.hidden, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                    attention=attention, window=window, qkv_bias=shape.qkv_bias, o_bias=shape.o_bias,
                    sinks=shape.sinks, qk_norm=shape.qk_norm)


def hf_layers(shape: HFShape, *, s: int, attention: str = "flash", imbalance: float = 1.0) -> tuple[Layer, ...]:
    """Embedding, the blocks (attention part + dense SwiGLU or MoE part + two RMSNorms and residuals, as
    ``builders.llama_layers`` counts them) and the final RMSNorm + head."""
    h, v, sh = shape.hidden, shape.vocab, s * shape.hidden
    embed = Layer("embed_tokens", "embedding", params=v * h, tp_params=v * h, ew_rep=1.0 * sh, ops=1, hidden=sh,
                  tp_allreduces=1, largest=v * h)
    # RMSNorm ×2 (three passes of read + write), residual add ×2; kept: both norms' inputs, the attention's and
    # the MLP's inputs
    common = dict(params=2 * h, ew_rep=18.0 * sh, ops=2, act_rep=4.0 * sh)
    blocks = []
    for i in range(shape.n_layer):
        mlp = (moe_part(s=s, h=h, n_experts=shape.n_experts, top_k=shape.top_k, ffn=shape.moe_ffn,
                        shared_ffn=shape.shared_ffn, shared_gate=shape.shared_gate, router_bias=shape.router_bias,
                        expert_bias=shape.expert_bias, imbalance=imbalance)
               if shape.moe[i] else swiglu_part(s=s, h=h, ffn=shape.ffn))
        blocks.append(block(f"layers.{i}", common, _attention(shape, s, shape.windows[i], attention), mlp, hidden=sh,
                            tp_allreduces=2))
    head = Layer("norm", "head", params=h + v * h, tp_params=v * h, gemms=(Gemm("lm_head", s, h, v, "col"),),
        ew_rep=6.0 * sh, ew_tp=4.0 * s * v, ops=6, act_rep=2.0 * sh, act_fp32=float(s * v),
        hidden=sh, tp_allreduces=1, tied="embed_tokens" if shape.tie else "", shared=v * h if shape.tie else 0,
        largest=v * h)
    return (embed, *blocks, head)


def tp_divisors(shape: HFShape) -> tuple[int, ...]:
    """What tensor parallelism must divide: the (kv) heads, the dense and expert widths, the vocabulary."""
    widths = [shape.heads if shape.mla else shape.kv_heads, shape.vocab]
    widths += [shape.ffn] if not all(shape.moe) else []
    widths += [w for w in (shape.moe_ffn, shape.shared_ffn) if w and any(shape.moe)]
    return tuple(dict.fromkeys(widths))
