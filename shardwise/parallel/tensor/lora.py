"""LoRA-adapted linear layers under tensor parallelism: the adapter follows its base layer's split.

A LoRA layer is recognised by its structure, never by import: a ``base_layer`` linear plus ``lora_A``/``lora_B``
— either ``nn.Linear`` children (``shardwise.models.lora.LoRALinear``) or ``nn.ModuleDict`` s keyed by adapter
name (``peft``'s ``lora.Linear``: one active adapter, no DoRA, not merged). The plan's style applies to the base
layer (replaced by the parallel module, as without LoRA) and the factors are cut so that the layer computes
exactly ``base(x) + B·A·dropout(x)·scaling`` of the one-device model:

| base style      | A (r, i)          | B (o, r)                    | adapter path on this rank                       |
|-----------------|-------------------|-----------------------------|-------------------------------------------------|
| Column / QKV    | B (replicated)    | S(0), split like W's rows   | h = A·x̂ (x̂ the base's gathered input), out += B_r·h |
| Row             | S(1)              | B (replicated)              | partial += B·(A_r·x_r), reduced with the base's partial |

The replicated factor's gradient is a partial sum over tp (column: dh = Σ_r B_rᵀ·dy_r; row: each rank's A_r·x_r is
a partial h), so it joins the gradient regions (``grad_regions.py``): one all-reduce per region, r × i or o × r
floats. The row adapter adds no collective (its partial joins the base's reduction; the async-tp overlap is not
used for an adapted row layer). Dropout draws in the region its input lives in: the column adapter's replicated
input uses the shared stream (every rank the same mask, as one device would), the row adapter's split input this
rank's stream — drawn before the row layer leaves the split region.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .modules import ColumnParallelLinear, RowParallelLinear, TPContext, shard_heads, shard_param
from .styles import ColumnParallel, QKVParallel, RowParallel, Style, VocabParallel

__all__ = ["LoraParts", "lora_parts", "is_lora_layer", "base_of", "lora_matches", "apply_lora_style"]


@dataclass
class LoraParts:
    """The pieces of one adapted linear: factor modules (``nn.Linear``), their names under the layer, dropout,
    scaling."""

    A: nn.Module
    B: nn.Module
    a_name: str
    b_name: str
    dropout: nn.Module
    scaling: float


def is_lora_layer(module: nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "lora_A") and \
        hasattr(module, "lora_B")


def base_of(module: nn.Module) -> nn.Module:
    """The base layer of a LoRA layer, the module itself otherwise."""
    return module.base_layer if is_lora_layer(module) else module


def lora_matches(matched: dict[str, Style], modules: dict[str, nn.Module]) -> dict[str, Style]:
    """The plan's matches with LoRA layers (``lora.py``) taken whole: a match of a LoRA layer's base
    (``<layer>.base_layer``) stands for the layer, matches inside an adapted layer are dropped. Pure."""
    adapted = [n for n, m in modules.items() if n and is_lora_layer(m)]
    out: dict[str, Style] = {}
    for name, style in matched.items():
        owner = next((a for a in adapted if name.startswith(a + ".")), None)
        if owner is None:
            out[name] = style
        elif name == f"{owner}.base_layer" and owner not in matched:
            out[owner] = style
    return {n: out[n] for n in modules if n in out}


def lora_parts(module: nn.Module) -> LoraParts | None:
    """The adapter of a LoRA layer (ours or peft's), None for any other module. ``ValueError`` for a peft layer
    this module cannot split (several active adapters, DoRA, a bias on B, merged weights)."""
    if not is_lora_layer(module):
        return None
    A, B = module.lora_A, module.lora_B
    if isinstance(A, nn.Linear):
        return LoraParts(A, B, "lora_A", "lora_B", module.lora_dropout, float(module.scaling))
    active = list(getattr(module, "active_adapters", []) or [])
    if len(active) != 1 or active[0] not in A:
        raise ValueError(f"{type(module).__name__}: tensor parallelism splits one active LoRA adapter, this layer "
                         f"has {active}; set one with peft_model.set_adapter(name)")
    key = active[0]
    if getattr(module, "use_dora", {}).get(key) or getattr(module, "lora_bias", {}).get(key) or \
            getattr(module, "merged", False):
        raise ValueError(f"{type(module).__name__}: DoRA, lora_bias and merged adapters are not split by tensor "
                         f"parallelism; train a plain LoRA adapter (use_dora=False, lora_bias=False), unmerged")
    return LoraParts(A[key], B[key], f"lora_A.{key}", f"lora_B.{key}", module.lora_dropout[key],
                     float(module.scaling[key]))


def apply_lora_style(name: str, module: nn.Module, style: Style, ctx: TPContext,
                     apply_base: Callable[[str, nn.Module], None],
                     partial: list[tuple[str, nn.Module, list[str]]]) -> None:
    """Apply ``style`` to the LoRA layer ``module`` (named ``name``): ``apply_base(name + '.base_layer', base)``
    replaces the base by its parallel module; the factors are cut as in the module doc, the replicated one is
    registered in ``partial`` and the layer's forward replaced. Local."""
    parts = lora_parts(module)
    assert parts is not None
    if isinstance(style, VocabParallel) or not isinstance(style, (ColumnParallel, QKVParallel, RowParallel)):
        raise ValueError(f"{name}: a LoRA-adapted layer takes ColumnParallel, QKVParallel or RowParallel, got "
                         f"{type(style).__name__}; leave LoRA off this layer or give it one of those styles")
    base_weight = module.base_layer.weight
    apply_base(f"{name}.base_layer", module.base_layer)
    parallel = module.base_layer
    if isinstance(parallel, RowParallelLinear):
        parts.A.weight = shard_param(parts.A.weight, ctx, 1)  # (r, i_r): the base's input split
        parts.B.weight = shard_param(parts.B.weight, ctx, None)
        partial.append((f"{name}.{parts.b_name}", parts.B, ["weight"]))
        module.forward = types.MethodType(_row_forward, module)
    else:
        assert isinstance(parallel, ColumnParallelLinear)
        heads = getattr(parallel.weight, "_shardwise_heads", None)
        parts.A.weight = shard_param(parts.A.weight, ctx, None)
        if heads is not None:  # split B's rows exactly like W's (whole heads of every fused chunk)
            per_chunk = heads[3][1 if heads[5] == 1 else 0] // heads[2]
            units = _units(style, per_chunk, base_weight)
            parts.B.weight = shard_heads(parts.B.weight, ctx, heads[2], units, dim=0)
        else:
            parts.B.weight = shard_param(parts.B.weight, ctx, 0)
        partial.append((f"{name}.{parts.a_name}", parts.A, ["weight"]))
        module.forward = types.MethodType(_column_forward, module)


def _units(style: Style, per_chunk: int, base_weight: torch.Tensor) -> int:
    """Heads (or features) per chunk of a head-split base: what ``shard_heads`` was given for W."""
    if isinstance(style, QKVParallel):
        return style.n_head
    assert isinstance(style, ColumnParallel)
    return style.heads if style.heads is not None else per_chunk


def _column_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x (b, t, i) [SP: (b, t_r, i)] → (b, t, o_r). The adapter reads the base's converted input (the same
    conversion: one backward all-reduce / reduce-scatter for both), drawn in the shared region before the base
    enters the split one."""
    parts = lora_parts(self)
    base: ColumnParallelLinear = self.base_layer
    xg = base.ctx.gather_input(x)  # (b, t, i), cached for the base's own matmul
    h = parts.A(parts.dropout(xg))  # (b, t, r), replicated; A's gradient partial over tp
    y = base(x)  # (b, t, o_r)
    return y + parts.B(h) * parts.scaling


def _row_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x (b, t, i_r) → (b, t, o) [SP: (b, t_r, o)]: the adapter's partial product joins the base's before the one
    reduction; the bias is added after it."""
    parts = lora_parts(self)
    base: RowParallelLinear = self.base_layer
    ctx = base.ctx
    h = parts.A(parts.dropout(x))  # (b, t, r) partial: this rank's input slice; dropout in the split region
    if not ctx.sequence_parallel:
        ctx.rng.leave_split()
    w = base.weight.t() if base.transposed else base.weight  # (o, i_r)
    y = ctx.reduce_output(F.linear(x, w) + parts.B(h) * parts.scaling)  # B's gradient partial over tp
    return y + base.bias if base.bias is not None else y
