"""Read a Hugging Face ``config.json`` of a Llama-family decoder into plain data, without ``transformers``.

Only the fields that decide the architecture and its numerics are read; everything else in the file (token
ids, ``use_cache``, ``torch_dtype``, ``architectures`` ...) is ignored because it does not change what
``shardwise.models.llama.Llama`` computes in training. What the native model does not implement is refused
with one line naming the field, its value and what is supported — never silently approximated:

* ``model_type``: the dense ``llama``, ``mistral``, ``qwen2``, ``qwen3`` and the mixtures of experts ``mixtral``
  (every layer MoE, top-k renormalised), ``qwen2_moe`` (a shared expert with its sigmoid gate, ``norm_topk_prob``,
  ``decoder_sparse_step``, ``mlp_only_layers``) and ``qwen3_moe`` (as qwen2_moe without the shared expert; q/k
  RMSNorm per head as ``qwen3``); the MoE layers are ``shardwise.models.moe.MoE`` (softmax router);
* a router with ``router_jitter_noise`` > 0 (Mixtral's training-time input noise) is refused (a renormalised
  top-1 router gives its expert weight 1, as transformers does);
* ``hidden_act``: ``silu`` (SwiGLU);
* rotary scaling (``rope_scaling`` / ``rope_parameters``): ``default``, ``linear`` (frequencies divided by
  ``factor``) and ``llama3`` (Llama 3.1's wavelength-dependent scaling); ``partial_rotary_factor`` 1 only;
* sliding-window attention is accepted only where it cannot change the result: a window of at least the
  training sequence length (``check_block_size``); a real window is refused;
* ``pretraining_tp`` > 1 (a Llama-1 era sliced matmul) is refused.

Field defaults are those of the ``transformers`` config classes of each type (a field absent from the file
means its default, as ``from_pretrained`` reads it).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

__all__ = ["HFDecoderConfig", "load_hf_config", "SUPPORTED_MODEL_TYPES", "MOE_TYPES"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")
_ROPE_TYPES = ("default", "linear", "llama3")

# Per model type: (q/k/v bias, o bias) when the file does not say (llama: ``attention_bias`` sets both; qwen2:
# always a q/k/v bias and no o bias), and the defaults of fields the types disagree on.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "qwen3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "head_dim": 128},
    "mixtral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5, "rope_theta": 1e6},
    "qwen2_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
    "qwen3_moe": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6},
}
_QWEN = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")  # sliding window only with use_sliding_window


@dataclass(frozen=True, kw_only=True)
class HFDecoderConfig:
    """The architecture of a Llama-family decoder, as read from its ``config.json`` (field names are HF's)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    """Width of one attention head (``hidden_size / num_attention_heads`` unless the file gives it)."""
    rms_norm_eps: float
    rope_theta: float
    rope_type: str = "default"
    """``default``, ``linear`` or ``llama3`` (``rope_scaling`` / ``rope_parameters``)."""
    rope_factor: float = 1.0
    """``linear`` and ``llama3``: the frequencies' scaling factor."""
    rope_low_freq_factor: float = 1.0
    """``llama3`` only."""
    rope_high_freq_factor: float = 4.0
    """``llama3`` only."""
    rope_original_max_positions: int = 8192
    """``llama3`` only: ``original_max_position_embeddings`` (the pre-training context)."""
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float = 0.0
    initializer_range: float = 0.02
    sliding_window: int | None = None
    """A window that the model type would apply (Mistral; Qwen2 with ``use_sliding_window``); None: none."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before the rotary embedding (``qwen3``, ``qwen3_moe``)."""
    num_experts: int = 0
    """Routed experts of an MoE layer (``num_local_experts`` in Mixtral's file); 0: a dense decoder."""
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    """Width of one expert (Mixtral: its ``intermediate_size``)."""
    shared_expert_intermediate_size: int = 0
    """Qwen2-MoE's shared expert (gated by a sigmoid of ``shared_expert_gate``); 0: none."""
    norm_topk_prob: bool = False
    """Divide the chosen top-k probabilities by their sum (Mixtral always does)."""
    router_aux_loss_coef: float = 0.0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    source: str = ""
    """Where it was read from (for messages)."""

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i`` is an MoE layer (HF's rule: experts on, not in ``mlp_only_layers``, and
        ``(i + 1) % decoder_sparse_step == 0``). Pure."""
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that ``transformers.AutoConfig.for_model(**d)`` reads back to this architecture."""
        d: dict[str, Any] = {k: getattr(self, k) for k in (
            "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
            "max_position_embeddings", "tie_word_embeddings", "attention_dropout", "initializer_range")}
        d["hidden_act"] = "silu"
        if self.rope_type != "default":
            d["rope_scaling"] = {"rope_type": self.rope_type, "factor": self.rope_factor}
        if self.rope_type == "llama3":
            d["rope_scaling"].update(low_freq_factor=self.rope_low_freq_factor,
                                     high_freq_factor=self.rope_high_freq_factor,
                                     original_max_position_embeddings=self.rope_original_max_positions)
        if self.model_type == "llama":
            d.update(attention_bias=self.qkv_bias, mlp_bias=self.mlp_bias)
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        if self.model_type in ("qwen3", "qwen3_moe"):
            d["attention_bias"] = self.qkv_bias
        return {**d, **self._moe_dict()}

    def _moe_dict(self) -> dict[str, Any]:
        """The MoE fields of ``hf_dict``, under each type's own names."""
        if self.model_type not in MOE_TYPES:
            return {}
        d: dict[str, Any] = {"num_experts_per_tok": self.num_experts_per_tok,
                             "router_aux_loss_coef": self.router_aux_loss_coef}
        if self.model_type == "mixtral":
            return {**d, "num_local_experts": self.num_experts, "router_jitter_noise": 0.0}
        d.update(num_experts=self.num_experts, moe_intermediate_size=self.moe_intermediate_size,
                 norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=self.decoder_sparse_step,
                 mlp_only_layers=list(self.mlp_only_layers))
        if self.model_type == "qwen2_moe":
            d.update(shared_expert_intermediate_size=self.shared_expert_intermediate_size, qkv_bias=self.qkv_bias)
        return d

    def check_block_size(self, block_size: int) -> None:
        """``ValueError`` when training windows of ``block_size`` tokens would not compute what the HF model
        computes: longer than ``max_position_embeddings``, or longer than a sliding window."""
        if block_size > self.max_position_embeddings:
            raise ValueError(f"model.block_size = {block_size} exceeds max_position_embeddings = "
                             f"{self.max_position_embeddings} of {self.source or 'the HF config'}; use --model.block_size "
                             f"{self.max_position_embeddings} or less")
        if self.sliding_window is not None and block_size > self.sliding_window:
            raise ValueError(f"{self.source or 'the HF config'}: sliding_window = {self.sliding_window} is shorter than "
                             f"model.block_size = {block_size}; sliding-window attention is not supported (only a "
                             f"window >= the sequence, where it changes nothing): use --model.block_size "
                             f"{self.sliding_window} or less, or set sliding_window to null")


def load_hf_config(path: str | Path) -> HFDecoderConfig:
    """Parse the ``config.json`` at ``path``. ``ValueError`` (one line) for a missing or unreadable file, invalid
    JSON, an unsupported model type or feature, or a bad value."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ValueError(f"model.hf_config = {str(path)!r}: no such file; pass the path of a Hugging Face "
                         f"config.json (e.g. examples/hf/tiny-llama.json)")
    try:
        raw = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"model.hf_config = {str(path)!r} cannot be read ({exc}); pass a readable config.json") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"model.hf_config = {str(path)!r} is not valid JSON (line {exc.lineno}: {exc.msg}); pass a "
                         f"Hugging Face config.json") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model.hf_config = {str(path)!r} holds a JSON {type(raw).__name__}, not an object of "
                         f"config fields; pass a Hugging Face config.json")
    return hf_config_from_dict(raw, source=str(p))


def hf_config_from_dict(raw: Mapping[str, Any], *, source: str = "") -> HFDecoderConfig:
    """The config of a parsed ``config.json`` dict (see ``load_hf_config``)."""
    where = source or "the HF config"
    mt = raw.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type = {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                         f"(Llama-family decoders and their mixtures of experts)")
    d = _DEFAULTS[mt]
    get = _Reader(raw, where)
    heads = get.int("num_attention_heads")
    hidden = get.int("hidden_size")
    kv = get.int("num_key_value_heads", heads)
    head_dim = get.int("head_dim", d.get("head_dim") or (hidden // heads if hidden % heads == 0 else 0))
    if heads % kv:
        raise ValueError(f"{where}: num_attention_heads = {heads} must be a multiple of num_key_value_heads = {kv} "
                         f"(grouped-query attention shares each key/value head among a whole group of query heads)")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act = {act!r} is not supported; supported: 'silu' (SwiGLU)")
    if raw.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"{where}: pretraining_tp = {raw['pretraining_tp']!r} is not supported; supported: 1")
    rope = _rope(raw, where, d.get("rope_theta", 10000.0))
    qkv_bias, o_bias = _biases(raw, mt)
    window = raw.get("sliding_window", d.get("sliding_window")) if mt in ("mistral", "mixtral") else (
        raw.get("sliding_window", 4096) if mt in _QWEN and raw.get("use_sliding_window", False) else None)
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise ValueError(f"{where}: sliding_window = {window!r} must be a positive int or null")
    dropout = get.float("attention_dropout", 0.0)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"{where}: attention_dropout = {dropout} must be in [0, 1)")
    return HFDecoderConfig(
        model_type=mt, vocab_size=get.int("vocab_size"), hidden_size=hidden,
        intermediate_size=get.int("intermediate_size"), num_hidden_layers=get.int("num_hidden_layers"),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=get.float("rms_norm_eps", d["rms_norm_eps"]), **rope,
        max_position_embeddings=get.int("max_position_embeddings", d["max_position_embeddings"]),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), qkv_bias=qkv_bias, o_bias=o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if mt == "llama" else False, attention_dropout=dropout,
        initializer_range=get.float("initializer_range", 0.02), sliding_window=window,
        qk_norm=mt in ("qwen3", "qwen3_moe"), **_moe_fields(raw, mt, get, where), source=source)


def _biases(raw: Mapping[str, Any], mt: str) -> tuple[bool, bool]:
    """(q/k/v bias, o bias): llama and qwen3 types' ``attention_bias`` sets both; qwen2 always has the q/k/v
    bias, qwen2_moe as its ``qkv_bias`` says (default on); mistral and mixtral have none."""
    flag = bool(raw.get("attention_bias", False))
    if mt in ("llama", "qwen3", "qwen3_moe"):
        return flag, flag
    if mt == "qwen2":
        return True, False
    if mt == "qwen2_moe":
        return bool(raw.get("qkv_bias", True)), False
    return flag, False


def _moe_fields(raw: Mapping[str, Any], mt: str, get: "_Reader", where: str) -> dict[str, Any]:
    """The MoE fields of a ``mixtral``/``qwen2_moe``/``qwen3_moe`` config (absent fields: transformers'
    defaults); {} for a dense type."""
    if mt not in MOE_TYPES:
        return {}
    mixtral = mt == "mixtral"
    # transformers names the count either way (an attribute_map): Qwen3-MoE's save_pretrained writes num_local_experts
    key = "num_local_experts" if raw.get("num_local_experts") is not None else "num_experts"
    experts = get.int(key, 8 if mixtral else (60 if mt == "qwen2_moe" else 128))
    top_k = get.int("num_experts_per_tok", 2 if mixtral else (4 if mt == "qwen2_moe" else 8))
    if top_k > experts:
        raise ValueError(f"{where}: num_experts_per_tok = {top_k} exceeds the {experts} experts; it must be at most "
                         f"the expert count")
    renorm = True if mixtral else bool(raw.get("norm_topk_prob", False))
    jitter = get.float("router_jitter_noise", 0.0)
    if jitter:
        raise ValueError(f"{where}: router_jitter_noise = {jitter} is not supported (training-time input noise); "
                         f"set it to 0.0")
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise ValueError(f"{where}: mlp_only_layers = {only!r} must be a list of layer indices")
    shared = get.int("shared_expert_intermediate_size", 5632) if mt == "qwen2_moe" else 0
    return {"num_experts": experts, "num_experts_per_tok": top_k, "norm_topk_prob": renorm,
            "moe_intermediate_size": get.int("intermediate_size" if mixtral else "moe_intermediate_size",
                                             14336 if mixtral else (1408 if mt == "qwen2_moe" else 768)),
            "shared_expert_intermediate_size": shared, "mlp_only_layers": tuple(sorted(set(only))),
            "router_aux_loss_coef": get.float("router_aux_loss_coef", 0.001),
            "decoder_sparse_step": 1 if mixtral else get.int("decoder_sparse_step", 1)}


def _rope(raw: Mapping[str, Any], where: str, theta: float = 10000.0) -> dict[str, Any]:
    """The ``rope_*`` fields from the old (``rope_theta`` + ``rope_scaling``) or the new (``rope_parameters``)
    spelling."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ValueError(f"{where}: rope_parameters / rope_scaling must be objects, got {params!r} / {scaling!r}")
    merged = {**scaling, **params}
    kind = merged.get("rope_type", merged.get("type", "default"))
    if kind not in _ROPE_TYPES:
        raise ValueError(f"{where}: rope type {kind!r} (rope_scaling / rope_parameters) is not supported; supported: "
                         f"{', '.join(_ROPE_TYPES)}")
    partial = merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor = {partial!r} is not supported; supported: 1.0")
    out: dict[str, Any] = {"rope_theta": merged.get("rope_theta", raw.get("rope_theta", theta)), "rope_type": kind}
    if kind != "default":
        out["rope_factor"] = merged.get("factor")
    if kind == "llama3":
        out.update(rope_low_freq_factor=merged.get("low_freq_factor"), rope_high_freq_factor=merged.get("high_freq_factor"),
                   rope_original_max_positions=merged.get("original_max_position_embeddings",
                                                          raw.get("max_position_embeddings")))
    for name, value in out.items():
        if name != "rope_type" and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{where}: rope {name.removeprefix('rope_')} = {value!r} (rope type {kind!r}) must be a "
                             f"positive number")
    if kind == "llama3" and out["rope_high_freq_factor"] <= out["rope_low_freq_factor"]:
        raise ValueError(f"{where}: rope high_freq_factor = {out['rope_high_freq_factor']} must exceed "
                         f"low_freq_factor = {out['rope_low_freq_factor']}")
    return {k: (v if k in ("rope_type", "rope_original_max_positions") else float(v)) for k, v in out.items()}


class _Reader:
    """Typed reads of one config dict, each failure naming the field."""

    def __init__(self, raw: Mapping[str, Any], where: str) -> None:
        self.raw, self.where = raw, where

    def int(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key)
        value = default if value is None else value  # null in the file: the type's default, as transformers reads it
        if value is None:
            raise ValueError(f"{self.where}: the field {key!r} is missing; a Llama-family config.json gives it")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{self.where}: {key} = {value!r} must be a positive int")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.raw.get(key, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{self.where}: {key} = {value!r} must be a non-negative number")
        return float(value)
