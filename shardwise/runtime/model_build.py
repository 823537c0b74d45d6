"""Which model a training config describes, and what the runtime needs to know about it: the reference GPT, or
(``model.hf_config``) the Llama-family decoder of a Hugging Face ``config.json`` (``shardwise.models.llama``).

The one place that tells the two apart: the strategies, the pipeline check, the metrics and the planner's spec
all ask here. Pure: nothing here communicates.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..models.gpt import GPT, GPTConfig
from ..models.hf_config import HFDecoderConfig, load_hf_config
from .config_schema import ModelConfig

__all__ = ["hf_of", "build_model", "block_names", "num_params", "meta_model", "attention_width", "model_spec",
           "hf_fields", "meta_model_for", "train_split_names", "planner_split_names", "saved_model", "resolve_hf", "resolve_pretrained", "with_adapters", "trainable_params",
           "check_tp", "HF_REPLICABLE", "model_mismatch", "resumable_model", "model_run_name"]


@functools.lru_cache(maxsize=16)
def _load(path: str, mtime_ns: int) -> HFDecoderConfig:
    return load_hf_config(path)


def hf_of(m: ModelConfig) -> HFDecoderConfig | None:
    """The parsed HF config of ``m.hf_config`` (cached while the file is unchanged); None for the GPT."""
    path = getattr(m, "hf_config", "")
    if not path:
        return None
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        stamp = -1  # load_hf_config names the problem
    return _load(path, stamp)


def hf_fields(hf: HFDecoderConfig) -> dict[str, Any]:
    """The ``[model]`` fields an HF config decides (``resolve_hf`` fills them in): the shape, and for a mixture
    of experts its MoE fields (so that ``--parallel.ep`` is checked against the real expert count), the
    routing rules the native model applies (softmax router, no capacity limit, no selection bias) included."""
    fields = {"vocab_size": hf.vocab_size, "n_layer": hf.num_hidden_layers, "n_head": hf.num_attention_heads,
              "n_embd": hf.hidden_size, "tie_weights": hf.tie_word_embeddings,
              "bias": hf.qkv_bias or hf.o_bias or hf.mlp_bias, "dropout": hf.attention_dropout,
              "n_experts": hf.num_experts}
    if not hf.num_experts:
        return fields
    ffn, shared, step = hf.moe_intermediate_size, hf.shared_expert_intermediate_size, hf.decoder_sparse_step
    fields.update(top_k=hf.num_experts_per_tok, moe_ffn=ffn, n_shared_experts=-(-shared // ffn),
                  router_renorm=hf.norm_topk_prob, moe_aux_loss_coef=hf.router_aux_loss_coef, router="softmax",
                  capacity_factor=0.0, moe_bias_rate=0.0)
    if not hf.mlp_only_layers:  # HF's (i + 1) % step == 0 is ours with step - 1 dense layers first
        fields.update(moe_every=step, moe_first_dense=step - 1)
    return fields


def build_model(m: ModelConfig) -> nn.Module:
    """A freshly initialised model of ``m`` (draws from the global RNG: seed first for identical replicas)."""
    hf = hf_of(m)
    if hf is not None:
        from ..models.llama import Llama

        return Llama(hf, m.block_size)
    return GPT(GPTConfig(**{f.name: getattr(m, f.name) for f in dataclasses.fields(GPTConfig)}))


def block_names(model: nn.Module) -> list[str]:
    """Qualified names of the repeated transformer layers (activation checkpointing, ZeRO-3 gather units)."""
    names = getattr(model, "block_names", None)
    if callable(names):
        return list(names())
    return [name for name, _ in model.named_modules() if re.fullmatch(r"blocks\.\d+", name)]


class _SkipRandomInit(TorchFunctionMode):
    """Random initialisers return their tensor untouched. On the meta device there is nothing to draw, yet torch
    runs ``normal_``/``uniform_`` there through a decomposition whose first call imports ``torch._dynamo``
    (~1 s of CPU): a launcher that only wants names and shapes should not pay it."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **kwargs)


_RANDOM_INITS = frozenset({"normal_", "uniform_", "trunc_normal_", "bernoulli_", "exponential_", "random_",
                           "cauchy_", "log_normal_", "geometric_"})


def meta_model(m: ModelConfig) -> nn.Module:
    """The model of ``m`` on the meta device (names, shapes, parameter counts; nothing allocated or drawn)."""
    with torch.device("meta"), _SkipRandomInit():
        return build_model(m)


def meta_model_for(cfg: Any) -> nn.Module:
    """The training config's model on the meta device, seeded by ``train.seed`` (its ``init_seed``: the values
    every layout draws) — or, with ``model.pretrained``, its tensors' sources the pretrained directory's files.
    Nothing is allocated: the strategies materialise each rank's pieces. Local."""
    torch.manual_seed(cfg.train.seed)
    # nothing is drawn on meta (the sources draw later): skipping the initialisers also spares every rank the
    # import of torch._dynamo their meta decomposition triggers (~75 MiB resident per rank, ~1 s)
    with torch.device("meta"), _SkipRandomInit():
        model = build_model(cfg.model)
    pretrained = getattr(cfg.model, "pretrained", "")
    if pretrained:
        from ..checkpoint.hf_dir import attach_pretrained

        # kept on the model: the trainer reports the bytes this rank's sources read (its share, not the model)
        model._shardwise_pretrained = attach_pretrained(model, pretrained, arch=_arch(cfg.model))
    if hasattr(cfg, "lora"):  # after the pretrained sources: LoRA moves each targeted layer under base_layer
        from .lora_setup import apply_run_lora

        apply_run_lora(model, cfg)
    return model


def num_params(m: ModelConfig) -> int:
    """Unique parameters of the model of ``m`` (``meta_model``: nothing is allocated)."""
    return meta_model(m).num_params()  # type: ignore[operator]


def attention_width(m: ModelConfig) -> int:
    """Width of the attention scores' inner products: ``n_embd`` for the GPT, heads × head_dim for an HF decoder
    (the attention term of ``metrics.flops_per_token``)."""
    hf = hf_of(m)
    return hf.num_attention_heads * hf.head_dim if hf is not None else m.n_embd


def model_spec(m: ModelConfig) -> Any:
    """The planner's analytic spec: ``ModelSpec.gpt`` or ``ModelSpec.llama`` (GQA k/v widths, three MLP matrices,
    the tied head). Approximations for an HF decoder: q/k/v and MLP biases are not counted (h-sized vectors), and
    an explicit ``head_dim`` other than hidden / heads is priced as hidden / heads; a mixture of experts is
    priced with its MoE fields (``hf_fields``: a Qwen2-MoE shared expert as ``n_shared_experts`` whole experts)."""
    from ..planner import ModelSpec

    hf = hf_of(m)
    if hf is None:
        return ModelSpec.gpt(m)
    moe = {k: v for k, v in hf_fields(hf).items() if k in _SPEC_MOE} if hf.num_experts else {}
    return ModelSpec.llama(n_layer=hf.num_hidden_layers, hidden=hf.hidden_size, heads=hf.num_attention_heads,
                           kv_heads=hf.num_key_value_heads, ffn=hf.intermediate_size, vocab_size=hf.vocab_size,
                           seq_len=m.block_size, tie_weights=hf.tie_word_embeddings, name=f"hf-{hf.model_type}",
                           **moe)


def _lora_meta_model(cfg: Any) -> nn.Module | None:
    """The run's model on the meta device with its LoRA applied (the base frozen); None without LoRA."""
    from .lora_setup import lora_config

    lc = lora_config(cfg.lora, 0) if hasattr(cfg, "lora") else None
    if lc is None:
        return None
    from ..models.lora import apply_lora

    model = meta_model(cfg.model)
    apply_lora(model, lc)
    return model


def _trainable(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)


def trainable_params(cfg: Any) -> int | None:
    """Trainable elements of a LoRA run's model (its adapters, counted on the meta model); None without LoRA."""
    model = _lora_meta_model(cfg)
    return None if model is None else _trainable(model)


def with_adapters(spec: Any, cfg: Any) -> Any:
    """``spec`` with the run's LoRA (``[lora]``): its base frozen and each layer's adapter elements added
    (``ModelSpec.with_adapters``), counted on the meta model; ``spec`` itself without LoRA."""
    model = _lora_meta_model(cfg)
    if model is None:
        return spec
    modules = dict(model.named_modules())
    counts: dict[str, int] = {}
    for layer in spec.layers:
        module = modules.get(train_split_names(cfg.model, (layer.name,))[0])
        if module is not None:
            counts[layer.name] = _trainable(module)
    left = _trainable(model) - sum(counts.values())
    if left > 0:  # adapters outside the planner's layers (an adapted LM head): priced with the last layer
        counts[spec.layers[-1].name] = counts.get(spec.layers[-1].name, 0) + left
    return spec.with_adapters(counts)


# the MoE fields the planner's Llama table takes (an HF config's mlp_only_layers is priced as MoE layers)
_SPEC_MOE = ("n_experts", "top_k", "moe_ffn", "n_shared_experts", "moe_every", "moe_first_dense")


# The planner's Llama layers are ``embed_tokens``, ``layers.i``, ``norm``; the model's pipeline units are the
# same under ``model.``.
def train_split_names(m: ModelConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """Planner layer names → pipeline unit names of the model of ``m``."""
    return tuple(f"model.{n}" for n in names) if hf_of(m) is not None else tuple(names)


def planner_split_names(m: ModelConfig, names: tuple[str, ...]) -> tuple[str, ...]:
    """Pipeline unit names → the planner's layer names."""
    return tuple(n.removeprefix("model.") for n in names) if hf_of(m) is not None else tuple(names)


def saved_model(saved: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's ``[model]`` dict with the fields added since it was written at their defaults (a checkpoint
    from before ``hf_config`` existed trained the GPT), so that it compares equal to the config it resumes under."""
    return {"hf_config": "", "pretrained": "", **saved}


def model_mismatch(saved: dict[str, Any], saved_hf: dict[str, Any] | None, m: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """How the model of ``m`` differs from a checkpoint's (``saved``: its ``[model]`` dict; ``saved_hf``: the HF
    architecture it stored, if any): ``{"model.key": (saved, now)}``, empty when a resume may load it. Where the
    weights first came from (``pretrained``) and where the HF config file lies (``hf_config``) are not the model:
    the shape fields, the kind (GPT or HF decoder) and the HF architecture are compared instead."""
    old, now = saved_model(saved), dataclasses.asdict(m)
    diff = {f"model.{k}": (old.get(k), v) for k, v in now.items()
            if k not in ("pretrained", "hf_config") and old.get(k) != v}
    if bool(old.get("hf_config")) != bool(m.hf_config):
        diff["model.hf_config"] = (old.get("hf_config"), m.hf_config)
    elif saved_hf is not None and m.hf_config:
        hf = hf_of(m)
        arch = hf.hf_dict() if hf is not None else {}
        diff.update({f"model.hf_config[{k!r}]": (saved_hf.get(k), arch.get(k)) for k in sorted(set(saved_hf) | set(arch))
                     if saved_hf.get(k) != arch.get(k)})
    return diff


def resumable_model(saved: dict[str, Any], saved_hf: dict[str, Any] | None, copy: Path) -> dict[str, Any]:
    """A checkpoint's ``[model]`` dict as a resume builds it, from the checkpoint alone (the trainer reads the
    weights from the checkpoint, never from ``pretrained``): a ``pretrained`` directory that no longer exists is
    cleared (one that exists stays, as where the run began: its tokenizer, a check of its headers), and an
    ``hf_config`` file that no longer exists is replaced by the architecture the checkpoint stored, written to
    ``copy``. ``ValueError`` when that file is gone and the checkpoint holds no copy."""
    out = dict(saved)
    if out.get("pretrained") and not os.path.isdir(out["pretrained"]):
        out["pretrained"] = ""
    path = out.get("hf_config") or ""
    if path and not os.path.isfile(path):
        if saved_hf is None:
            raise ValueError(f"--resume: the run's model.hf_config {path!r} does not exist and its checkpoint holds no "
                             f"copy of it; restore the file, or pass --model.hf_config PATH of the same architecture")
        tmp = copy.with_name(f".{copy.name}.tmp")
        tmp.write_text(json.dumps(saved_hf, indent=1))
        os.replace(tmp, copy)
        out["hf_config"] = str(copy.resolve())
    return out


def model_run_name(m: ModelConfig) -> str:
    """The default run name of a model read from files: a ``pretrained`` directory's name; an ``hf_config`` file's
    name without ``.json`` (its directory's name for a file called ``config.json``, as HF names it); '' for the
    reference GPT (its preset names the run)."""
    if m.pretrained:
        return Path(m.pretrained).name
    if m.hf_config:
        path = Path(m.hf_config)
        return path.parent.name if path.stem == "config" else path.stem
    return ""


def resolve_hf(m: ModelConfig, given: dict[str, Any]) -> ModelConfig:
    """``m`` with the fields its ``hf_config`` decides filled in (the path made absolute, so that ranks and a later
    ``--resume`` from elsewhere read the same file). ``given``: the ``[model]`` values set explicitly (TOML, flags);
    one that contradicts the file is a ``ValueError`` naming both. Unchanged without ``hf_config``."""
    if not m.hf_config:
        return m
    path = str(os.path.abspath(os.path.expanduser(m.hf_config)))
    hf = hf_of(dataclasses.replace(m, hf_config=path))
    assert hf is not None
    fields = hf_fields(hf)
    for key, value in fields.items():
        if key in given and given[key] != value:
            raise ValueError(f"model.{key} = {given[key]!r} contradicts model.hf_config {path!r}, which makes it "
                             f"{value!r}; drop --model.{key} (the HF config sets the model's shape)")
    hf.check_block_size(m.block_size)
    return dataclasses.replace(m, hf_config=path, **fields)


def resolve_pretrained(m: ModelConfig, given: dict[str, Any]) -> ModelConfig:
    """``m`` with the fields ``model.pretrained``'s directory decides: a GPT-2 directory the reference GPT's shape, a
    Llama-family one ``hf_config`` = its ``config.json`` (then ``resolve_hf`` fills the shape). The directory is
    checked here, before anything launches (headers only: files, index, every tensor's name, shape and dtype
    against the model's). ``ValueError`` naming a ``[model]`` value that contradicts the directory. Unchanged
    without ``pretrained``."""
    if not m.pretrained:
        return m
    from ..checkpoint.hf_dir import attach_pretrained, open_pretrained, pretrained_config

    path = str(os.path.abspath(os.path.expanduser(m.pretrained)))
    pretrained = open_pretrained(path)
    kind = pretrained.config.get("model_type")
    if kind == "gpt2":
        fields = pretrained_config(pretrained, arch="gpt")
        out = dataclasses.replace(m, pretrained=path, **fields)
    else:
        fields = {"hf_config": str(pretrained.config_path)}
        out = dataclasses.replace(m, pretrained=path, **fields)
    for key, value in fields.items():
        if key in given and given[key] != value and not (key == "hf_config" and os.path.abspath(given[key]) == value):
            raise ValueError(f"model.{key} = {given[key]!r} contradicts model.pretrained {path!r}, which makes it "
                             f"{value!r}; drop --model.{key} (the pretrained directory sets the model's shape)")
    if kind != "gpt2":
        out = resolve_hf(out, {k: v for k, v in given.items() if k != "hf_config"})
    attach_pretrained(meta_model(out), pretrained, arch=_arch(out))  # names, shapes and dtypes, nothing read
    return out


def _arch(m: ModelConfig) -> str:
    hf = hf_of(m)
    return "gpt" if hf is None else hf.model_type


def check_tp(m: ModelConfig, tp: int, ep: int = 1) -> None:
    """``ValueError`` when ``tp`` cannot split the model's heads (whole heads per rank; for an HF decoder also
    whole key/value heads, so that every rank keeps whole query groups)."""
    hf = hf_of(m)
    counts = {"model.n_head": m.n_head} if hf is None else {
        "num_attention_heads": hf.num_attention_heads, "num_key_value_heads": hf.num_key_value_heads}
    for name, n in counts.items():
        if n % tp:
            raise ValueError(f"parallel.tp = {tp} must divide {name} = {n} (whole heads per rank); use a tp from "
                             f"{[d for d in range(1, n + 1) if n % d == 0]}")
    if hf is not None and tp > 1:
        _check_hf_tp(hf, tp, ep)


def _check_hf_tp(hf: HFDecoderConfig, tp: int, ep: int = 1) -> None:
    """An HF decoder's extra tensor-parallel limits: its experts split over tp (``ExpertParallel``; with ep > 1
    they stay whole on tp, split over ep instead), and no per-head q/k norm (its weight's gradient would be a
    partial sum over the heads' ranks)."""
    if ep == 1 and hf.num_experts % tp:
        raise ValueError(f"parallel.tp = {tp} must divide num_experts = {hf.num_experts} (the MoE layers' experts "
                         f"are split over tp); use a tp from {[d for d in range(1, hf.num_experts + 1) if hf.num_experts % d == 0]}")
    if hf.qk_norm:
        raise ValueError(f"parallel.tp = {tp} is not supported for model_type {hf.model_type!r} (its per-head q/k "
                         f"RMSNorm is shared by heads on different tp ranks); use --parallel.tp 1")


HF_REPLICABLE = {"model.embed_tokens": "embed_tokens", "lm_head": "norm"}
"""An HF decoder's ``parallel.replicate`` names → the planner's Llama layer that holds the module."""
