"""A checkpoint read as the whole model an export writes: ``ExportView(ckpt, merge_lora=...)``.

It answers ``keys``/``full``/``index``/``state``/``path``/``step`` as ``Checkpoint`` does, so the exporters read it
in place of the checkpoint:

* Frozen parameters a checkpoint left out (``train.save_frozen = false``: the index state lists them under
  ``frozen_not_saved``) are read from the run's ``model.pretrained`` directory, where they came from and where they
  stay unchanged (a LoRA base is frozen): fp32, GPT-2's Conv1D weights transposed back to (out, in).
* ``merge_lora``: each adapted base weight W (out, in) of ``model/<m>.base_layer.weight`` is read as
  ``model/<m>.weight`` = W + scaling·B·A in fp32 (B (out, r), A (r, in); scaling alpha / r, or alpha / sqrt(r) with
  rsLoRA, from the run's ``lora`` section), ``.base_layer`` leaves every name and the adapters are absent.

``checkpoint_adapter(ckpt)`` is the other way out of a LoRA run: its adapters alone, as ``write_peft_dir`` takes
them (``peft_adapter.py``), a reference GPT's under GPT-2's module names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .hf_map import _file_key, gpt2_key
from .hf_read import PretrainedDir, open_pretrained
from .peft_adapter import adapter_config, check_pairs, is_lora_key, lora_fields, scaling, target_modules_for
from .sharded import Checkpoint

__all__ = ["ExportView", "checkpoint_adapter", "OMITTED_STATE"]

OMITTED_STATE = "frozen_not_saved"
"""The index-state entry naming the frozen parameters a checkpoint left out (``checkpoint/frozen.py``)."""


def _pretrained(ckpt: Checkpoint) -> PretrainedDir:
    config = ckpt.state.get("config") if isinstance(ckpt.state.get("config"), dict) else {}
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    where = model.get("pretrained") or ""
    if not where or not Path(where).expanduser().is_dir():
        raise ValueError(f"checkpoint {ckpt.path}: its frozen base was not saved (train.save_frozen = false) and its "
                         f"model.pretrained directory {where!r} is not there to read it from; restore that directory "
                         f"or export with --format peft (the adapters alone)")
    return open_pretrained(Path(where).expanduser())


class ExportView:
    """``ckpt`` as the whole (optionally merged) model: see the module docstring. ValueError for a LoRA run whose
    adapted weight is tied to another (merging would change both) or whose left-out base cannot be read."""

    def __init__(self, ckpt: Checkpoint, *, merge_lora: bool = False) -> None:
        self.ckpt, self.path, self.step, self.state = ckpt, ckpt.path, ckpt.step, ckpt.state
        self.scale = 0.0
        if merge_lora:
            config = ckpt.state.get("config") if isinstance(ckpt.state.get("config"), dict) else {}
            self.scale = scaling(lora_fields(config.get("lora", {}), f"checkpoint {ckpt.path}"))
            for alias, original in ckpt.state.get("aliases", {}).items():
                if ".base_layer." in alias + original:
                    raise ValueError(f"checkpoint {ckpt.path}: the adapted {alias!r} is tied to {original!r}; "
                                     f"merging its adapter would change both: export the adapters with --format peft")
        self.merge = merge_lora
        self.source: dict[str, str] = {}  # the view's key -> the checkpoint's (or the omitted parameter's) key
        self.files: dict[str, tuple[str, bool]] = {}  # omitted key -> (pretrained file key, transposed)
        tensors: dict[str, Any] = {}
        for key, info in ckpt.index["tensors"].items():
            if not (merge_lora and key.startswith("model/") and is_lora_key(key)):
                tensors[self._name(key)] = info
                self.source[self._name(key)] = key
        omitted = [n for n in ckpt.state.get(OMITTED_STATE) or [] if n not in ckpt.state.get("aliases", {})]
        self.pretrained = _pretrained(ckpt) if omitted else None
        for name in omitted:
            key, info = self._omitted(f"model/{name}")
            tensors[self._name(key)] = info
            self.source[self._name(key)] = key
        self.index = {**ckpt.index, "tensors": tensors}

    def _name(self, key: str) -> str:
        return key.replace(".base_layer.", ".") if self.merge and key.startswith("model/") else key

    def _omitted(self, key: str) -> tuple[str, dict[str, Any]]:
        """(key, index entry) of a left-out parameter, found in the pretrained directory (under the base's name)."""
        assert self.pretrained is not None
        arch = "llama" if "hf_config" in self.state else "gpt"
        name = key.removeprefix("model/").replace(".base_layer.", ".")
        file_key, transpose = _file_key(self.pretrained, arch, name)
        if file_key is None:
            raise ValueError(f"checkpoint {self.path}: its frozen {name!r} was not saved (train.save_frozen = false) "
                             f"and {self.pretrained.where()} holds no tensor for it; export from the pretrained "
                             f"directory the run started from")
        self.files[key] = (file_key, transpose)
        shape = self.pretrained.tensors[file_key].shape
        return key, {"full_shape": list(reversed(shape)) if transpose else list(shape)}

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.index["tensors"] if k.startswith(prefix)]

    def _raw(self, key: str) -> torch.Tensor:
        if key in self.files:
            assert self.pretrained is not None
            file_key, transpose = self.files[key]
            return self.pretrained.source(file_key, torch.float32, transpose=transpose).read()
        return self.ckpt.full(key)

    def full(self, key: str) -> torch.Tensor:
        """The view's tensor ``key`` in full (a merged weight: W + scaling·B·A, computed in fp32)."""
        source = self.source.get(key, key)
        t = self._raw(source)
        if self.merge and source.endswith(".base_layer.weight"):
            module = source.removesuffix(".base_layer.weight")
            a, b = self.ckpt.full(f"{module}.lora_A.weight"), self.ckpt.full(f"{module}.lora_B.weight")
            t = (t.float() + self.scale * (b.float() @ a.float())).to(t.dtype)  # (out, r) @ (r, in)
        return t


def checkpoint_adapter(ckpt: Checkpoint) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(``adapter_config.json`` dict, ``{model key: tensor}``) of a LoRA run's checkpoint: its adapters read in
    full (fp32 as trained), its LoRA section (``config["lora"]``), ``target_modules`` that select exactly the
    adapted modules, ``base_model_name_or_path`` = the run's ``model.pretrained``. ValueError for a checkpoint
    without adapters or without its LoRA section."""
    keys = [k for k in ckpt.keys("model/") if is_lora_key(k)]
    if not keys:
        raise ValueError(f"checkpoint {ckpt.path}: holds no LoRA adapters (no '<module>.lora_A.weight' tensors); "
                         f"--format peft exports a run trained with --lora.r: use --format hf for this one")
    config = ckpt.state.get("config") if isinstance(ckpt.state.get("config"), dict) else {}
    fields = lora_fields(config.get("lora", {}), f"checkpoint {ckpt.path}")
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        t = ckpt.full(key)
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"checkpoint {ckpt.path}: {key!r} holds NaN/Inf values; refusing to export a diverged "
                             f"adapter; export an earlier checkpoint (pass its directory)")
        tensors[key[len("model/"):]] = t.contiguous()
    check_pairs(tensors, fields["r"], f"checkpoint {ckpt.path}")
    names = [k[len("model/"):] for k in ckpt.keys("model/")] + list(ckpt.state.get(OMITTED_STATE) or [])
    modules = {n.removesuffix(".weight").removesuffix(".bias").removesuffix(".base_layer") for n in names
               if not is_lora_key(n)}
    gpt = "hf_config" not in ckpt.state  # the reference GPT: GPT-2's module names (Conv1D: fan_in_fan_out)
    if gpt:
        tensors, modules = _as_gpt2(tensors, modules)
    adapted = {k.rsplit(".", 2)[0] for k in tensors}
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    pretrained = model.get("pretrained") or None
    return adapter_config(fields, target_modules_for(adapted, modules), base_model=pretrained,
                          fan_in_fan_out=gpt), tensors


def _as_gpt2(tensors: dict[str, torch.Tensor], modules: set[str]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The reference GPT's adapters and module names under GPT-2's (``blocks.0.attn.qkv`` →
    ``transformer.h.0.attn.c_attn``). A and B keep their shapes: peft's adapters on a Conv1D base are nn.Linear
    too, (r, in) and (out, r); only the base weight is stored transposed."""
    def name(module: str) -> str:
        try:
            return gpt2_key(module + ".weight")[0].removesuffix(".weight")
        except ValueError:
            return module  # lm_head, wte...: GPT-2 has them under the same names or has no such linear layer
    renamed = {}
    for key, t in tensors.items():
        module, which, attr = key.rsplit(".", 2)
        renamed[f"{name(module)}.{which}.{attr}"] = t
    return renamed, {name(m) for m in modules}
