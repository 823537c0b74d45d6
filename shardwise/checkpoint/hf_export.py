"""A sharded checkpoint as a Hugging Face model directory: ``(config.json, tensors one at a time)``.

* A Llama-family run (``model.hf_config``; the checkpoint's state holds ``hf_config``): HF's keys as they are,
  ``config.json`` = that ``hf_config`` plus ``architectures``; a tied ``lm_head.weight`` is left out (the config's
  ``tie_word_embeddings`` ties it again, as ``save_pretrained`` does). Mixtures of experts (mixtral, qwen2_moe,
  qwen3_moe) are written in the Hub's per-expert layout (``hf_experts.hub_tensors``: one 3-D weight read, its
  experts written one by one), the selection bias ``expert_bias`` left out (not a tensor of these types).
* A reference-GPT run: GPT-2's keys and layout (``hf_map``: Linear (out, in) → Conv1D (in, out)), zeros for the
  biases GPT-2 always has where the run's model has none (``model.bias = false``), ``config.json`` of
  ``gpt2_config_from_gpt``.

A LoRA run (adapters ``<module>.lora_A.weight``/``lora_B.weight`` beside ``<module>.base_layer.weight``) is
exported merged only (``merge_lora=True``): each base weight W (out, in) becomes W + scaling·B·A computed in fp32,
``.base_layer`` leaves the names and the adapters are dropped, so the directory is a plain model of the base's
architecture (``export_view.ExportView``, which also reads a base that ``train.save_frozen = false`` left out of
the checkpoint from the run's ``model.pretrained``); without ``merge_lora`` it is refused (``--format peft`` writes the adapters alone).

Tensors are read from the checkpoint one at a time (``Checkpoint.full``), each checked finite, so exporting holds
one full tensor. Checkpoint tensors are fp32 master weights and are written as they are.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from .hf_experts import hub_tensors
from .hf_map import LLAMA_TYPES, gpt2_config_from_gpt, gpt2_key
from .export_view import OMITTED_STATE, ExportView
from .peft_adapter import is_lora_key
from .sharded import Checkpoint

__all__ = ["hf_export", "ARCHITECTURES"]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM"}
_GPT_KEYS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "tie_weights")


def _finite(ckpt: Checkpoint, key: str) -> torch.Tensor:
    t = ckpt.full(key)
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"checkpoint {ckpt.path}: {key!r} holds NaN/Inf values; refusing to export a diverged "
                         f"model; export an earlier checkpoint (pass its directory, e.g. "
                         f"{ckpt.path.parent}/step_NNNNNN)")
    return t


def hf_export(ckpt: Checkpoint, *, merge_lora: bool = False) -> tuple[dict[str, Any],
                                                                      Iterator[tuple[str, torch.Tensor]]]:
    """(``config.json`` object, iterator of ``(HF key, tensor)``) of the model in ``ckpt`` (see the module
    docstring). The iterator reads the checkpoint lazily: ``CheckpointError``/``ValueError`` surface while it is
    consumed (a damaged piece, a non-finite tensor). ``merge_lora``: a LoRA run's adapters folded into their base
    weights (required for a LoRA run, refused for another)."""
    lora = any(is_lora_key(k) for k in ckpt.keys("model/"))
    if lora and not merge_lora:
        raise ValueError(f"checkpoint {ckpt.path}: holds LoRA adapters; pass --merge-lora to write the merged model "
                         f"(W + scaling·B·A), or --format peft for the adapters alone")
    if merge_lora and not lora:
        raise ValueError(f"--merge-lora: checkpoint {ckpt.path} holds no LoRA adapters (not trained with --lora.r); "
                         f"drop --merge-lora")
    if lora or ckpt.state.get(OMITTED_STATE):  # merged, and/or a frozen base read from model.pretrained
        ckpt = ExportView(ckpt, merge_lora=lora)  # type: ignore[assignment]  # reads as a Checkpoint
    if "hf_config" in ckpt.state:
        return _llama(ckpt)
    return _gpt(ckpt)


def _llama(ckpt: Checkpoint) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    config = dict(ckpt.state["hf_config"])
    if config.get("model_type") not in LLAMA_TYPES:
        raise ValueError(f"checkpoint {ckpt.path}: hf_config model_type = {config.get('model_type')!r} is not "
                         f"exported; supported: {', '.join(LLAMA_TYPES)}")
    config.setdefault("architectures", [ARCHITECTURES[config["model_type"]]])
    config.setdefault("dtype", "float32")
    keys = ckpt.keys("model/")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for key in keys:
            if not key.endswith(".expert_bias"):
                yield from hub_tensors(key[len("model/"):], _finite(ckpt, key), config["model_type"])

    return config, tensors()


def _gpt_config(ckpt: Checkpoint) -> dict[str, Any]:
    model = ckpt.state.get("config", {}).get("model", {})
    missing = [k for k in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd") if k not in model]
    if missing:
        raise ValueError(f"checkpoint {ckpt.path}: its state holds no model config ({', '.join(missing)} missing); "
                         f"it was not saved by `shardwise train`: export it with --format safetensors")
    cfg = {k: model[k] for k in _GPT_KEYS if k in model}
    cfg["tie_weights"] = "lm_head.weight" in ckpt.state.get("aliases", {}) or (
        cfg.get("tie_weights", True) and "model/lm_head.weight" not in ckpt.index["tensors"])
    return cfg


def _gpt_names(cfg: dict[str, Any]) -> list[str]:
    """The reference GPT's parameter names as if it had every bias (GPT-2 has), in GPT-2's order."""
    names = ["wte.weight", "wpe.weight"]
    for i in range(int(cfg["n_layer"])):
        for module in ("ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.fc", "mlp.proj"):
            names += [f"blocks.{i}.{module}.weight", f"blocks.{i}.{module}.bias"]
    names += ["ln_f.weight", "ln_f.bias"]
    return names + ([] if cfg["tie_weights"] else ["lm_head.weight"])


def _gpt(ckpt: Checkpoint) -> tuple[dict[str, Any], Iterator[tuple[str, torch.Tensor]]]:
    cfg = _gpt_config(ckpt)
    experts = int(ckpt.state.get("config", {}).get("model", {}).get("n_experts", 0) or 0)
    if experts:
        raise ValueError(f"checkpoint {ckpt.path}: a reference GPT with experts (model.n_experts = {experts}) "
                         f"has no Hugging Face model type; export it with --format safetensors, or train an HF MoE "
                         f"type (--model.hf_config of a mixtral, qwen2_moe or qwen3_moe config) to export --format hf")
    held = set(ckpt.keys("model/"))
    names = _gpt_names(cfg)
    expected = {f"model/{n}" for n in names}
    extra = sorted(held - expected)
    if extra:
        raise ValueError(f"checkpoint {ckpt.path}: {extra[0]!r} has no place in GPT-2's layout; export it with "
                         f"--format safetensors")
    for n in names:
        if f"model/{n}" not in held and not n.endswith(".bias"):
            raise ValueError(f"checkpoint {ckpt.path}: holds no tensor 'model/{n}'; the checkpoint is incomplete")

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for n in names:
            key, transpose = gpt2_key(n)
            if f"model/{n}" in held:
                t = _finite(ckpt, f"model/{n}")
                yield key, (t.t() if transpose else t)
                del t  # not held while the next one is read
            else:  # model.bias = false: GPT-2's bias is zero
                weight = ckpt.index["tensors"][f"model/{n.removesuffix('.bias')}.weight"]
                yield key, torch.zeros(int(weight["full_shape"][0]), dtype=torch.float32)

    return gpt2_config_from_gpt(cfg), tensors()
