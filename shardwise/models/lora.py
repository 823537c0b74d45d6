"""LoRA (Hu et al. 2021): low-rank adapters on a frozen base, with the module layout and key names of ``peft``.

    model = Llama(config, block_size)                           # or any model with nn.Linear layers
    names = sw.apply_lora(model, sw.LoRAConfig(r=8, alpha=16, targets=("q_proj", "v_proj")))
    # every parameter but the adapters is frozen; strategies apply unchanged (tp splits each adapter with its base)

Each targeted ``nn.Linear`` W (o, i) becomes a ``LoRALinear`` holding it as ``base_layer`` and adding
``lora_B(lora_A(dropout(x))) · alpha / r``: ``lora_A`` (r, i), ``lora_B`` (o, r) — peft's names, shapes and order
of operations, so an adapter's keys are peft's with the adapter name left out
(``<module>.lora_A.weight``; PEFT's file prefixes them with ``base_model.model.``: ``peft_key``). Initial values
follow peft's default: A uniform in ±1/sqrt(i) (``nn.Linear``'s Kaiming-uniform bound), B zero, so the adapted
model starts equal to the base. A is drawn by rule from ``(seed, name)`` (``init_rules``): the same values in
every layout, and on the meta device only the pieces a rank keeps.

``targets`` are module-name suffixes (``q_proj`` matches ``model.layers.3.self_attn.q_proj``) or ``fnmatch``
patterns over the full names (``*.layers.[0-3].*.q_proj``), as peft's ``target_modules`` list. A target must
match at least one ``nn.Linear``. ``use_rslora`` scales by alpha / sqrt(r) (peft's rsLoRA).
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from ..parallel.common.init_rules import Constant, Uniform, draw_full
from ..parallel.common.materialize import InitSource, set_source

__all__ = ["LoRAConfig", "LoRALinear", "apply_lora", "merge_lora", "lora_modules", "lora_state_dict",
           "peft_key", "PEFT_PREFIX"]

PEFT_PREFIX = "base_model.model."
"""What PEFT's adapter files put before a module name (``PeftModel`` → ``LoraModel`` → the base model)."""


@dataclass(frozen=True)
class LoRAConfig:
    """A LoRA setup: rank ``r``, scale numerator ``alpha`` (the update is scaled by alpha / r), ``targets``
    (module-name suffixes or fnmatch patterns), ``dropout`` on the adapter's input, ``use_rslora``
    (alpha / sqrt(r)), ``seed`` for A's initial values (default: ``torch.initial_seed()`` when applied)."""

    r: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ("q_proj", "v_proj")
    dropout: float = 0.0
    use_rslora: bool = False
    seed: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r <= 0:
            raise ValueError(f"LoRA rank r must be a positive int, got {self.r!r}; typical values are 8 to 64")
        if not self.alpha > 0:
            raise ValueError(f"LoRA alpha must be > 0 (the update is scaled by alpha / r), got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t.strip() for t in targets):
            raise ValueError(f"LoRA targets must be non-empty module names or patterns (e.g. q_proj,v_proj), got "
                             f"{self.targets!r}")
        object.__setattr__(self, "targets", tuple(t.strip() for t in targets))

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


class LoRALinear(nn.Module):
    """``base_layer(x) + lora_B(lora_A(lora_dropout(x))) · scaling``; x (..., i) → (..., o). The base is frozen by
    ``apply_lora``; ``merged`` is set once ``merge_lora`` folded the update into the base."""

    def __init__(self, base: nn.Linear, r: int, scaling: float, dropout: float) -> None:
        super().__init__()
        i, o = base.in_features, base.out_features
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.base_layer = base
        self.lora_A = nn.Linear(i, r, bias=False, **kw)  # weight (r, i)
        self.lora_B = nn.Linear(r, o, bias=False, **kw)  # weight (o, r)
        self.lora_dropout: nn.Module = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling, self.r = float(scaling), r
        self.in_features, self.out_features = i, o
        self.merged = False

    def forward(self, x: Tensor) -> Tensor:
        y = self.base_layer(x)
        if self.merged:
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}{', merged' if self.merged else ''}"


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target) or fnmatch.fnmatchcase(name, target)


def _targets(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Names of the ``nn.Linear`` modules ``cfg.targets`` select, in module order; ValueError for a target that
    selects none (naming what the model's linear layers are called)."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n]
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters (apply_lora was called); apply it once")
    for t in cfg.targets:
        if not any(_matches(n, t) for n in linears):
            kinds = sorted({n.rpartition(".")[2] for n in linears})
            raise ValueError(f"LoRA target {t!r} matches no nn.Linear module; this model's linear layers are "
                             f"named {kinds[:12]} (pass suffixes such as q_proj,v_proj)")
    return [n for n in linears if any(_matches(n, t) for t in cfg.targets)]


def apply_lora(model: nn.Module, cfg: LoRAConfig, *, freeze: bool = True) -> list[str]:
    """Put a ``LoRALinear`` in place of every targeted ``nn.Linear`` of ``model`` (in place) and, with ``freeze``,
    set ``requires_grad=False`` on every other parameter. Returns the adapted module names. Works on a meta-device
    model (the adapters get init sources: each rank draws only its pieces). Call it before any strategy wraps the
    model, after pretrained weights are attached or loaded. Local."""
    names = _targets(model, cfg)
    if freeze:
        for p in model.parameters():
            p.requires_grad_(False)
    seed = int(cfg.seed if cfg.seed is not None else torch.initial_seed())
    for name in names:
        base = model.get_submodule(name)
        lora = LoRALinear(base, cfg.r, cfg.scaling, cfg.dropout)
        _init_adapter(lora, name, seed)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, lora)
    return names


def _init_adapter(lora: LoRALinear, name: str, seed: int) -> None:
    """A ~ U(±1/sqrt(i)) drawn from ``(seed, <name>.lora_A.weight)``; B = 0 (peft's default: the adapted model
    starts equal to the base)."""
    bound = 1.0 / math.sqrt(lora.in_features)
    for key, param, rule in ((f"{name}.lora_A.weight", lora.lora_A.weight, Uniform(-bound, bound)),
                             (f"{name}.lora_B.weight", lora.lora_B.weight, Constant(0.0))):
        if param.is_meta:
            set_source(param, InitSource(key, rule, seed, tuple(param.shape), param.dtype))
        else:
            with torch.no_grad():
                param.copy_(draw_full(rule, seed, key, param.shape, param.dtype))


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """``{name: LoRALinear}`` of ``model`` in module order."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def peft_key(name: str) -> str:
    """PEFT's file key of an adapter tensor named ``name`` in the model (``<module>.lora_A.weight``)."""
    return PEFT_PREFIX + name


def lora_state_dict(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The adapter tensors of a full state dict (``sw.full_state_dict`` of a LoRA model) under PEFT's keys."""
    return {peft_key(k): v for k, v in state.items() if ".lora_A." in k or ".lora_B." in k}


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its base weight (W += scaling · B·A) and mark it merged (forward = the base alone).
    Needs full, unsharded weights (merge a model built from a full state dict). Returns the merged names."""
    out = []
    for name, m in lora_modules(model).items():
        if not m.merged:
            w = m.base_layer.weight
            w.add_((m.lora_B.weight.float() @ m.lora_A.weight.float() * m.scaling).to(w.dtype))
            m.merged = True
            out.append(name)
    return out
