"""LoRA adapters in PEFT's format: an adapter directory out of a checkpoint, and read back in.

A PEFT adapter directory holds ``adapter_config.json`` (peft's ``LoraConfig``: ``peft_type`` "LORA", ``r``,
``lora_alpha``, ``target_modules``, ...) and ``adapter_model.safetensors`` whose keys are
``base_model.model.<module>.lora_A.weight`` (r, in) and ``...lora_B.weight`` (out, r), ``<module>`` the adapted
``nn.Linear``'s name in the base model (``model.layers.0.self_attn.q_proj``). ``peft.PeftModel.from_pretrained``
loads it onto a ``transformers`` model of the base.

* ``write_peft_dir(out, tensors, config)``: the directory from adapter tensors under the model's keys
  (``<module>.lora_A.weight``, as ``shardwise.models.lora`` names them) and a LoRA section (``r``, ``alpha``,
  ``targets``, ``dropout``, ``use_rslora``), atomically (a temporary directory beside ``out``, then renamed).
* ``read_peft_dir(dir)``: (the adapter config, ``{model key: tensor}``), refusing what ``LoRALinear`` cannot
  express (DoRA, adapter biases, per-module ranks or scales, extra trained modules).
* ``check_adapter(tensors, shapes)``: every adapter tensor names an adapted (or adaptable) linear layer of the model
  with the right shape — else "an adapter directory for another base or another architecture".

A LoRA run's checkpoint becomes (adapter config, tensors) in ``export_view.checkpoint_adapter``.

The user's guide is docs/training.md, "Pretrained weights in and out".
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from .hf_write import _publish
from .integrity import fsync_path

__all__ = ["write_peft_dir", "read_peft_dir", "read_peft_config", "check_adapter", "check_pairs", "adapter_config", "scaling",
           "target_modules_for", "lora_fields", "is_lora_key", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_PREFIX"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""PEFT's key prefix (``PeftModel`` → ``LoraModel`` → the base model); the same constant as
``shardwise.models.lora.PEFT_PREFIX`` (checkpoint/ and models/ are one layer and do not import each other)."""
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<which>lora_A|lora_B)\.(?:(?P<adapter>[^.]+)\.)?weight$")

_REFUSED: tuple[tuple[str, Any, str], ...] = (
    ("use_dora", False, "DoRA (use_dora) adds a magnitude vector LoRALinear does not have; use a plain LoRA adapter"),
    ("lora_bias", False, "lora_bias trains a bias on lora_B that LoRALinear does not have; use an adapter without it"),
    ("modules_to_save", None, "modules_to_save trains whole modules besides the adapters; only LoRA tensors are "
                              "loaded: use an adapter without modules_to_save"),
    ("trainable_token_indices", None, "trainable_token_indices trains embedding rows besides the adapters; use an "
                                      "adapter without them"),
    ("rank_pattern", {}, "rank_pattern gives modules their own rank; shardwise's LoRA has one rank for all: use an "
                         "adapter without rank_pattern"),
    ("alpha_pattern", {}, "alpha_pattern gives modules their own scale; shardwise's LoRA has one alpha for all: use "
                          "an adapter without alpha_pattern"),
    ("layer_replication", None, "layer_replication duplicates base layers; use an adapter without it"),
    ("target_parameters", None, "target_parameters adapts raw parameters, not nn.Linear layers; use target_modules"),
    ("alora_invocation_tokens", None, "activated LoRA (alora_invocation_tokens) changes when adapters apply; use a "
                                      "plain LoRA adapter"),
    ("use_qalora", False, "QA-LoRA (use_qalora) pools the adapter's input; use a plain LoRA adapter"),
    ("bias", "none", "bias other than 'none' trains base biases stored with the adapter; use bias='none'"),
)
"""``(field, the value meaning "off", why)``: adapter_config fields whose other values read_peft_dir refuses."""


def is_lora_key(key: str) -> bool:
    """``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (a model key of an adapter tensor)."""
    return key.endswith((".lora_A.weight", ".lora_B.weight"))


def lora_fields(section: Mapping[str, Any], where: str) -> dict[str, Any]:
    """``r``, ``alpha``, ``dropout``, ``use_rslora``, ``targets`` (a list) of a LoRA section (a run's saved
    ``config["lora"]``); ValueError naming ``where`` when the section is missing or has no rank."""
    r = section.get("r") if isinstance(section, Mapping) else None
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or "alpha" not in section:
        raise ValueError(f"{where}: its saved config holds no LoRA section with r > 0 and alpha (got "
                         f"{dict(section) if isinstance(section, Mapping) else section!r}); it was not trained with "
                         f"--lora.r: export it with --format hf or safetensors")
    targets = section.get("targets", [])
    targets = [t.strip() for t in targets.split(",")] if isinstance(targets, str) else list(targets)
    return {"r": r, "alpha": float(section["alpha"]), "dropout": float(section.get("dropout", 0.0) or 0.0),
            "use_rslora": bool(section.get("use_rslora", False)), "targets": [t for t in targets if t]}


def scaling(fields: Mapping[str, Any]) -> float:
    """alpha / r (alpha / sqrt(r) with ``use_rslora``): what multiplies B·A."""
    r = int(fields["r"])
    return float(fields["alpha"]) / (r ** 0.5 if fields.get("use_rslora") else r)


def target_modules_for(adapted: Iterable[str], modules: Iterable[str]) -> list[str]:
    """peft's ``target_modules`` list that selects exactly the ``adapted`` module names among ``modules`` (every
    module of the base): their last name parts (``q_proj``) when each such part selects adapted modules only, else
    the full names (peft's list matches a module whose name equals an entry or ends with "." + entry)."""
    adapted = sorted(set(adapted))
    suffixes = sorted({m.rpartition(".")[2] for m in adapted})
    chosen = set(adapted)
    others = [m for m in modules if m not in chosen]
    if any(m == s or m.endswith("." + s) for m in others for s in suffixes):
        return adapted
    return suffixes


def adapter_config(fields: Mapping[str, Any], target_modules: Sequence[str], *, base_model: str | None = None,
                   fan_in_fan_out: bool = False) -> dict[str, Any]:
    """``adapter_config.json`` of a plain LoRA adapter (peft 0.21's ``LoraConfig`` fields that matter for loading;
    the others keep peft's defaults when it reads the file)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model or None,
            "revision": None, "inference_mode": True, "r": int(fields["r"]), "lora_alpha": float(fields["alpha"]),
            "target_modules": list(target_modules), "exclude_modules": None,
            "lora_dropout": float(fields.get("dropout", 0.0)), "fan_in_fan_out": bool(fan_in_fan_out),
            "bias": "none", "use_rslora": bool(fields.get("use_rslora", False)), "modules_to_save": None,
            "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
            "alpha_pattern": {}, "use_dora": False, "lora_bias": False, "layer_replication": None,
            "target_parameters": None}


def _check_out(out: Path) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory; pass a new directory path")
    if any(out.iterdir()) and not (out / ADAPTER_CONFIG).is_file():
        raise ValueError(f"--out {str(out)!r} is a non-empty directory without {ADAPTER_CONFIG}, not an adapter "
                         f"directory; refusing to replace it: pass a new or empty directory")


def write_peft_dir(out: str | Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any]) -> Path:
    """Write the adapter directory ``out``: ``adapter_config.json`` = ``config`` (``adapter_config``'s dict) and
    ``adapter_model.safetensors`` with ``tensors`` (model keys ``<module>.lora_A.weight`` / ``lora_B.weight``)
    under PEFT's keys. Atomic: an existing adapter directory at ``out`` is replaced only once the new one is
    complete; anything else at ``out`` is refused (ValueError) before anything is written. Returns ``out``."""
    from safetensors.torch import save_file

    out = Path(out).expanduser().absolute()
    bad = [k for k in tensors if not is_lora_key(k)]
    if not tensors or bad:
        raise ValueError(f"write_peft_dir: tensors must be adapter tensors '<module>.lora_A.weight' / "
                         f"'<module>.lora_B.weight', got {bad[:3] or 'none'}")
    _check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp, old = out.parent / f".{out.name}.tmp-{os.getpid()}", out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        state = {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in sorted(tensors.items())}
        save_file(state, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        fsync_path(tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        fsync_path(tmp / ADAPTER_CONFIG)
        fsync_path(tmp)
        _publish(tmp, out, old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {ADAPTER_CONFIG} is unreadable ({exc}); pass a PEFT adapter directory "
                         f"(save_pretrained of a PeftModel, or shardwise export --format peft)") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else type(config).__name__
        raise ValueError(f"{path}: {ADAPTER_CONFIG} has peft_type {kind!r}, only 'LORA' adapters are supported; "
                         f"pass a LoRA adapter directory")
    for field, off, why in _REFUSED:
        value = config.get(field, off)
        if not (value is None or value == off or (off != "none" and not value)):  # {}, [], False, 0: off too
            raise ValueError(f"{path}: {ADAPTER_CONFIG} has {field} = {value!r}: {why}")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(config.get("lora_alpha"), (int, float)):
        raise ValueError(f"{path}: {ADAPTER_CONFIG} has r = {r!r}, lora_alpha = {config.get('lora_alpha')!r}; "
                         f"both must be positive numbers (r an int)")
    return config


def _model_key(key: str, path: Path) -> str:
    """``base_model.model.<module>.lora_A[.<adapter>].weight`` → ``<module>.lora_A.weight``."""
    match = _LORA_KEY.match(key.removeprefix(PEFT_PREFIX))
    if not key.startswith(PEFT_PREFIX) or match is None:
        raise ValueError(f"{path}: {ADAPTER_WEIGHTS} holds {key!r}, not a LoRA tensor "
                         f"'{PEFT_PREFIX}<module>.lora_A.weight' / 'lora_B.weight' (DoRA, bias or saved modules are "
                         f"not supported); pass a plain LoRA adapter directory")
    return f"{match['module']}.{match['which']}.weight"


def read_peft_config(directory: str | Path) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT LoRA adapter directory, checked as ``read_peft_dir`` checks it (both files
    present, peft_type LORA, no unsupported variant) without reading the tensors: a cheap check before launch."""
    path = Path(directory).expanduser()
    missing = [name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (path / name).is_file()]
    if missing:
        legacy = " (adapter_model.bin is not read: re-save it with safe_serialization)" if (
            path / "adapter_model.bin").is_file() else ""
        raise ValueError(f"{path}: not a PEFT adapter directory, {' and '.join(missing)} missing{legacy}; pass the "
                         f"directory save_pretrained (peft) or shardwise export --format peft wrote")
    return _read_config(path)


def read_peft_dir(directory: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(``adapter_config.json`` as a dict, ``{model key: tensor}``) of a PEFT LoRA adapter directory, keys as
    ``shardwise.models.lora`` names them (``<module>.lora_A.weight``: PEFT's prefix and any adapter name dropped).
    One-line ValueError for a missing file, another PEFT type, an unsupported LoRA variant, stray or unpaired
    tensors, or ranks that differ from the config's ``r``."""
    from safetensors.torch import load_file

    path = Path(directory).expanduser()
    config = read_peft_config(path)
    tensors: dict[str, torch.Tensor] = {}
    for key, value in load_file(str(path / ADAPTER_WEIGHTS)).items():
        name = _model_key(key, path)
        if name in tensors:
            raise ValueError(f"{path}: {ADAPTER_WEIGHTS} holds {name!r} twice (two adapter names?); save one adapter")
        tensors[name] = value
    check_pairs(tensors, int(config["r"]), path)
    return config, tensors


def check_pairs(tensors: Mapping[str, torch.Tensor], r: int, where: Any) -> None:
    if not tensors:
        raise ValueError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA tensors; pass a LoRA adapter directory")
    for key, t in sorted(tensors.items()):
        module, which = key.rsplit(".", 2)[0], key.rsplit(".", 2)[1]
        other = f"{module}.{'lora_B' if which == 'lora_A' else 'lora_A'}.weight"
        if other not in tensors:
            raise ValueError(f"{where}: adapter {key!r} has no {other!r}; the adapter file is incomplete")
        rank = t.shape[0] if which == "lora_A" else t.shape[-1]
        if t.dim() != 2 or rank != r:
            raise ValueError(f"{where}: adapter {key!r} has shape {tuple(t.shape)}, not rank r = {r} of "
                             f"{ADAPTER_CONFIG}; the adapter file and its config disagree")


def check_adapter(tensors: Mapping[str, torch.Tensor], shapes: Mapping[str, Sequence[int]], *,
                  complete: bool = True) -> None:
    """Check adapter ``tensors`` (model keys) against a model's tensor ``shapes`` (``{name: shape}``, e.g. from
    ``{k: v.shape for k, v in model.state_dict().items()}`` of the full, unsharded model, with or without LoRA
    applied): each ``<module>`` must be a linear layer of the model — ``<module>.base_layer.weight`` (adapted) or
    ``<module>.weight`` (out, in) — with A (r, in) and B (out, r); with ``complete`` and a model already adapted,
    every adapter of the model must be in ``tensors``. ValueError naming the key and both shapes otherwise."""
    for key, t in sorted(tensors.items()):
        module, _, which = key.removesuffix(".weight").rpartition(".")
        base = next((shapes[k] for k in (f"{module}.base_layer.weight", f"{module}.weight") if k in shapes), None)
        if base is None or len(base) != 2:
            raise ValueError(f"adapter {key!r}: the model has no linear layer {module!r} (an adapter directory for "
                             f"another base or another architecture); pass an adapter trained on this base model")
        out_f, in_f = int(base[0]), int(base[1])
        r = t.shape[0] if which == "lora_A" else t.shape[-1]
        want = shapes.get(key) or ((r, in_f) if which == "lora_A" else (out_f, r))
        if tuple(t.shape) != tuple(want):
            raise ValueError(f"adapter {key!r} has shape {tuple(t.shape)}, the model's is {tuple(want)} (base "
                             f"weight {(out_f, in_f)}): an adapter directory for another base or another "
                             f"architecture; pass an adapter trained on this base model")
    if complete:
        absent = sorted(k for k in shapes if is_lora_key(k) and k not in tensors)
        if absent:
            raise ValueError(f"the model's adapter {absent[0]!r} is not in the adapter directory ({len(absent)} "
                             f"missing): its target modules differ; pass the same --lora.targets the adapter has")
