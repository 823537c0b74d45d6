"""``shardwise train``'s LoRA: the ``[lora]`` section resolved (with ``lora.init``'s PEFT adapter directory) into a
``LoRAConfig``, applied to the meta-device model after its pretrained sources are attached, and the adapters'
sources set from the directory's tensors when it starts from one.

Order matters: the pretrained directory maps its tensors onto the plain model's names (``q_proj.weight``) before
LoRA moves each targeted layer under ``base_layer``; the same Parameter objects keep their sources, so every layout
still reads only its pieces. The adapters are small: ``lora.init``'s tensors are read whole and each rank keeps its
pieces of them (``TensorSource``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..models.lora import LoRAConfig, apply_lora, lora_modules
from ..parallel.common.materialize import rows_then_index, set_source

__all__ = ["lora_config", "resolved_lora", "lora_given", "apply_run_lora", "check_lora", "TensorSource", "ADAPTER_CONFIG"]

ADAPTER_CONFIG = "adapter_config.json"


class TensorSource:
    """A meta tensor's values from a tensor held in memory (an adapter read from a PEFT directory)."""

    def __init__(self, value: torch.Tensor, dtype: torch.dtype) -> None:
        self.value, self.dtype, self.shape = value, dtype, tuple(value.shape)

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        return self.value.reshape(-1)[start:stop].to(self.dtype).clone()

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        return rows_then_index(self.read_flat, self.shape, index)


def _adapter_config(directory: str) -> dict[str, Any]:
    path = Path(directory).expanduser() / ADAPTER_CONFIG
    if not path.is_file():
        raise ValueError(f"lora.init = {directory!r} is not a PEFT adapter directory (no {ADAPTER_CONFIG}); pass the "
                         f"directory that `shardwise export RUN --format peft` or peft's save_pretrained wrote")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: unreadable adapter config ({e}); re-export the adapter") from None
    if str(raw.get("peft_type", "")).upper() != "LORA":
        raise ValueError(f"{path}: peft_type = {raw.get('peft_type')!r}; only LoRA adapters are read (peft_type LORA)")
    return raw


def _targets_of(raw: dict[str, Any]) -> tuple[str, ...]:
    t = raw.get("target_modules")
    return (t,) if isinstance(t, str) else tuple(sorted(t or ()))


def lora_config(section: Any, seed: int) -> LoRAConfig | None:
    """The run's ``LoRAConfig`` from the ``[lora]`` section (None when LoRA is off). With ``lora.init`` the adapter
    directory's r, alpha, targets, dropout and rsLoRA fill what the section leaves at its defaults; a value given
    that disagrees with the directory's r or targets is a ``ValueError`` (the adapter would not fit)."""
    if not section.init and section.r == 0:
        return None
    targets = tuple(t for t in section.targets.split(",") if t.strip())
    if not section.init:
        return LoRAConfig(r=section.r, alpha=section.alpha, targets=targets, dropout=section.dropout,
                          use_rslora=section.use_rslora, seed=seed)
    raw = _adapter_config(section.init)
    r, saved_targets = int(raw.get("r", 0)), _targets_of(raw)
    if section.r and section.r != r:
        raise ValueError(f"lora.r = {section.r} but the adapter in {section.init} has r = {r}; drop --lora.r (the "
                         f"adapter sets it) or start without --lora.init")
    return LoRAConfig(r=r, alpha=float(raw.get("lora_alpha", section.alpha)), targets=saved_targets or targets,
                      dropout=float(raw.get("lora_dropout", section.dropout) or 0.0),
                      use_rslora=bool(raw.get("use_rslora", section.use_rslora)), seed=seed)


def resolved_lora(section: Any) -> Any:
    """The section with ``lora.init``'s r, alpha, targets, dropout and rsLoRA written in (what the run trains: its
    saved config resumes without the directory); the section itself without ``lora.init``."""
    if not section.init:
        return section
    lc = lora_config(section, 0)
    assert lc is not None
    return dataclasses.replace(section, r=lc.r, alpha=lc.alpha, targets=",".join(lc.targets), dropout=lc.dropout,
                               use_rslora=lc.use_rslora)


def lora_given(section: Any, given: dict[str, Any]) -> None:
    """A ``--lora.*`` setting given while LoRA stays off (no ``lora.r``, no ``lora.init``) is a mistake, not a no-op."""
    default = type(section)()  # a saved config lists every field: only a changed one is a setting
    extra = sorted(k for k, v in given.items() if k not in ("r", "init") and v != getattr(default, k))
    if extra and section.r == 0 and not section.init:
        raise ValueError(f"lora.{extra[0]} is set but lora.r = 0 (LoRA off); pass --lora.r R (e.g. 8) to train "
                         f"adapters, or drop the --lora.* flags for full fine-tuning")


def check_lora(section: Any, meta_model: Callable[[], nn.Module] | None = None) -> None:
    """The section's ranges and, given ``meta_model`` (the run's model on the meta device), its targets against
    that model — before anything is launched (``ValueError`` naming the field and the fix)."""
    if section.r < 0:
        raise ValueError(f"lora.r = {section.r} must be >= 0 (0 = no LoRA); typical ranks are 8 to 64")
    if section.r > 0 or section.init:
        LoRAConfig(r=max(section.r, 1), alpha=section.alpha, targets=tuple(section.targets.split(",")),
                   dropout=section.dropout)  # its own checks: alpha > 0, dropout in [0, 1), targets given
    if section.init:
        from ..checkpoint.peft_adapter import read_peft_config

        _adapter_config(section.init)
        read_peft_config(section.init)  # both files, no DoRA / rank_pattern / other unsupported variant
    lc = lora_config(section, 0)
    if lc is not None and meta_model is not None:
        model = meta_model()
        apply_lora(model, lc)  # raises for a target that names no linear layer
        if section.init:  # the adapter against the model's shapes (the tensors are small: read here)
            from ..checkpoint.peft_adapter import check_adapter, read_peft_dir

            check_adapter(read_peft_dir(section.init)[1],
                          {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()})


def apply_run_lora(model: nn.Module, cfg: Any) -> list[str]:
    """Apply the run's LoRA to the meta-device ``model`` (every other parameter frozen); with ``lora.init`` the
    adapters' sources are the directory's tensors (checked against the model: names and shapes). Returns the
    adapted module names (empty when LoRA is off). Local."""
    lc = lora_config(cfg.lora, cfg.train.seed)
    if lc is None:
        return []
    names = apply_lora(model, lc)
    if cfg.lora.init:
        from ..checkpoint.peft_adapter import read_peft_dir

        _, tensors = read_peft_dir(cfg.lora.init)
        _attach_adapter(model, tensors, cfg.lora.init)
    return names


def _attach_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], where: str) -> None:
    params = {f"{n}.{f}.weight": getattr(m, f).weight for n, m in lora_modules(model).items()
              for f in ("lora_A", "lora_B")}
    extra = sorted(set(tensors) - set(params))
    missing = sorted(set(params) - set(tensors))
    if extra or missing:
        raise ValueError(f"{where}: the adapter does not fit this model (adapter tensors without a LoRA module: "
                         f"{extra[:3]}; LoRA modules without an adapter tensor: {missing[:3]}); it was trained for "
                         f"another base or other targets")
    from ..checkpoint.peft_adapter import check_adapter

    check_adapter(tensors, {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()})
    for key, p in params.items():
        set_source(p, TensorSource(tensors[key], p.dtype))
