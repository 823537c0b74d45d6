"""What ``shardwise generate`` loads: the model of a run, a checkpoint or a Hugging Face directory, on one device.

* A run directory: its newest checkpoint that verifies (``latest_intact_checkpoint``: a damaged latest one is
  skipped with a warning); a checkpoint directory: that one, verified. Either is read whole in any layout it
  was saved in (``consolidate``, as ``shardwise export`` does) into the model the checkpoint's state describes:
  the reference GPT of its ``[model]`` config, or the Llama-family decoder of its ``hf_config``.
* A Hugging Face directory (``config.json`` + safetensors): GPT-2 → the reference GPT, Llama/Mistral/Qwen2 →
  ``shardwise.models.llama.Llama``, read with ``sw.load_pretrained`` and ``sw.materialize``.

The model is first built on the meta device, so that the prompt can be checked against its vocabulary and
context before the weights are loaded (a checkpoint's files are read once before, to verify their checksums).
Every failure is one ``UsageError`` line. The tokenizer is ``generate_text.py``'s business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..checkpoint.hf_read import CONFIG, INDEX, SINGLE
from ..checkpoint.integrity import CheckpointError, latest_intact_checkpoint, verify_checkpoint
from ..checkpoint.sharded import Checkpoint
from ..models.gpt import GPT, GPTConfig
from ..models.hf_config import HFDecoderConfig, hf_config_from_dict
from ..models.llama import Llama

__all__ = ["UsageError", "Source", "find_source", "meta_model_of", "load_weights"]


class UsageError(ValueError):
    """A bad input to ``shardwise generate``: one line naming the value and the fix."""


@dataclass
class Source:
    """What ``RUN_OR_DIR`` turned out to be."""

    kind: str
    """``checkpoint`` (given directly or found in a run directory) or ``hf``."""
    path: Path
    """The checkpoint directory, or the Hugging Face directory."""
    run: Path | None = None
    """The run directory holding the checkpoint (None for a bare checkpoint or an HF directory)."""
    warnings: list[str] = field(default_factory=list)
    """Checkpoints skipped on the way (damaged), one line each."""
    state: dict[str, Any] = field(default_factory=dict)
    """The checkpoint's JSON state (config, hf_config, aliases); the HF directory's config.json."""


_WHAT = "pass a run directory (runs/NAME), a checkpoint directory (…/checkpoints/step_NNNNNN) or a Hugging Face " \
        "model directory (config.json + safetensors)"


def _is_run(p: Path) -> bool:
    """Whether ``p`` looks like a ``shardwise train`` run directory (its files, not an HF config.json)."""
    if (p / "metrics.jsonl").is_file() or (p / "launch.json").is_file():
        return True
    try:
        cfg = json.loads((p / CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and isinstance(cfg.get("train"), dict) and isinstance(cfg.get("model"), dict)


def _from_run(p: Path) -> Source:
    found, skipped = latest_intact_checkpoint(p)
    warnings = [f"skipped checkpoint {where}: {why}" for where, why in skipped]
    if found is None and not skipped:
        raise UsageError(f"run {str(p)!r} holds no checkpoint yet; train it until it saves one (train.ckpt_every "
                         f"steps, and at the end) or pass another run")
    if found is None:
        raise UsageError(f"run {str(p)!r} holds no intact checkpoint ({len(skipped)} damaged; the newest: "
                         f"{skipped[0][1]}); "
                         f"restore the files or train it again")
    return Source("checkpoint", found, run=p, warnings=warnings)


def find_source(path: str) -> Source:
    """Classify ``path`` and find its checkpoint (verified) or its HF directory; reads no tensor values
    except for the checksums of ``verify_checkpoint``. ``UsageError`` for anything else."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UsageError(f"RUN_OR_DIR {path!r} does not exist; {_WHAT}")
    if not p.is_dir():
        raise UsageError(f"RUN_OR_DIR {path!r} is a file, not a directory; {_WHAT}")
    try:
        if (p / "index.json").is_file():
            verify_checkpoint(p)
            src = Source("checkpoint", p, run=p.parent.parent if p.parent.name == "checkpoints" else None)
        elif (p / "checkpoints").is_dir():
            src = _from_run(p)
        elif (p / CONFIG).is_file() and _is_run(p):
            raise UsageError(f"run {path!r} holds no checkpoint (no checkpoints/ directory); train it until it saves "
                             f"one (train.ckpt_every steps, and at the end) or pass another run")
        elif (p / CONFIG).is_file() and ((p / SINGLE).is_file() or (p / INDEX).is_file()):
            config = json.loads((p / CONFIG).read_text())
            return Source("hf", p, state=config if isinstance(config, dict) else {})
        else:
            raise UsageError(f"RUN_OR_DIR {path!r} is not a run, a checkpoint or a Hugging Face model directory (no "
                             f"checkpoints/, index.json, or config.json with model.safetensors in it); {_WHAT}")
        src.state = Checkpoint(src.path).state
    except (CheckpointError, OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: {exc}") from None
    return src


@contextlib.contextmanager
def _meta() -> Iterator[None]:
    """Build on the meta device (no memory, no draws; ``load_weights`` fills it in). Random initialisers are
    skipped as ``model_build.meta_model`` skips them: on meta their first call imports ``torch._dynamo`` (seconds
    of a command that should start fast)."""
    from ..runtime.model_build import _SkipRandomInit

    with torch.device("meta"), _SkipRandomInit():
        yield


def llama_context(hf: HFDecoderConfig) -> int:
    """Positions a Llama-family decoder attends over: ``max_position_embeddings``, or a shorter sliding window
    (the native model computes full attention, which equals a window only while the sequence fits in it)."""
    return min(hf.max_position_embeddings, hf.sliding_window or hf.max_position_embeddings)


def _gpt_of(model: dict[str, Any], where: str) -> GPT:
    names = {f.name for f in dataclasses.fields(GPTConfig)}
    missing = sorted({"vocab_size", "block_size", "n_layer", "n_head", "n_embd"} - set(model))
    if missing:
        raise UsageError(f"{where}: its state holds no model config ({', '.join(missing)} missing); it was not "
                         f"saved by `shardwise train`: pass a run's checkpoint or a Hugging Face directory")
    cfg = GPTConfig(**{**{k: v for k, v in model.items() if k in names}, "dropout": 0.0})  # inference: no dropout
    with _meta():
        return GPT(cfg)


def meta_model_of(src: Source) -> nn.Module:
    """The model ``src`` holds, on the meta device (shapes only; a LoRA run's with its adapters, unmerged).
    ``UsageError`` for an architecture the native models do not compute (one line from the config readers)."""
    model = _meta_model_of(src)
    config = src.state.get("config") if src.kind == "checkpoint" else None
    lora = config.get("lora") if isinstance(config, dict) else None
    if isinstance(lora, dict) and int(lora.get("r", 0) or 0) > 0:
        from ..models.lora import LoRAConfig, apply_lora

        targets = tuple(t for t in str(lora.get("targets", "")).split(",") if t.strip())
        apply_lora(model, LoRAConfig(r=int(lora["r"]), alpha=float(lora.get("alpha", 16.0)), targets=targets,
                                     use_rslora=bool(lora.get("use_rslora", False))))
    return model


def _meta_model_of(src: Source) -> nn.Module:
    try:
        if src.kind == "checkpoint":
            if "hf_config" in src.state:
                hf = hf_config_from_dict(src.state["hf_config"], source=f"checkpoint {src.path}")
                with _meta():
                    return Llama(dataclasses.replace(hf, attention_dropout=0.0), llama_context(hf))
            config = src.state.get("config", {})
            return _gpt_of(config.get("model", {}) if isinstance(config, dict) else {}, f"checkpoint {src.path}")
        from ..checkpoint.hf_map import gpt_config_from_gpt2

        where, kind = str(src.path / CONFIG), src.state.get("model_type")
        if kind not in ("gpt2", "llama", "mistral", "qwen2"):
            raise UsageError(f"{where}: model_type = {kind!r} is not supported by shardwise generate; supported: "
                             f"gpt2, llama, mistral, qwen2 (dense decoders our models compute)")
        if kind == "gpt2":
            return _gpt_of(gpt_config_from_gpt2(src.state, where=where), where)
        hf = hf_config_from_dict(src.state, source=where)
        with _meta():
            return Llama(dataclasses.replace(hf, attention_dropout=0.0), llama_context(hf))
    except (TypeError, ValueError) as exc:
        raise UsageError(str(exc)) from None


def _load_checkpoint(model: nn.Module, src: Source, device: torch.device) -> None:
    from .export import consolidate

    tensors, _ = consolidate(src.path)
    names = dict(model.named_parameters(remove_duplicate=False))
    extra, missing = sorted(set(tensors) - set(names)), sorted(set(names) - set(tensors))
    # a tied head is one Parameter under two names: the checkpoint may hold it under either or both
    missing = [n for n in missing if not any(names[n] is names[m] for m in tensors if m in names)]
    if extra or missing:
        raise UsageError(f"checkpoint {src.path}: its tensors do not fit the model its config describes "
                         f"(extra {extra[:3]}, missing {missing[:3]}); pass a checkpoint saved by `shardwise train`")
    from ..parallel.common.materialize import swap_in

    for name, p in model.named_parameters():  # each Parameter once: swapping keeps every tie
        value = tensors[name] if name in tensors else next(tensors[m] for m in tensors if names.get(m) is p)
        if tuple(value.shape) != tuple(p.shape):
            raise UsageError(f"checkpoint {src.path}: {name!r} has shape {tuple(value.shape)}, the model of its config "
                             f"needs {tuple(p.shape)}; the checkpoint is damaged or from another model")
        swap_in(p, nn.Parameter(value.to(device=device, dtype=p.dtype), requires_grad=False))


def load_weights(model: nn.Module, src: Source, device: torch.device) -> nn.Module:
    """Fill the meta ``model`` with ``src``'s weights on ``device`` (fp32, no gradients). ``UsageError`` for a
    damaged checkpoint or directory, a non-finite tensor, or tensors that do not fit."""
    try:
        if src.kind == "checkpoint":
            _load_checkpoint(model, src, device)
        else:
            from ..checkpoint.hf_dir import load_pretrained
            from ..parallel.common.materialize import materialize_model

            materialize_model(load_pretrained(model, src.path), device)
            model.requires_grad_(False)
    except (CheckpointError, OSError) as exc:
        raise UsageError(f"{src.path}: {exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return model.eval()
