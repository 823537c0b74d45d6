"""``ModelSpec`` of any ``nn.Module``, measured by running its forward once on the meta device (no memory, no
FLOPs spent): every matrix product with its shape, the traffic and launches of every other kernel, and the
bytes autograd saves for backward (``saved_tensors_hooks``), attributed to the *unit* running at the time.

Units are where a pipeline may cut: the entries of every ``nn.ModuleList`` / ``nn.Sequential`` with two or
more children (found at any depth, e.g. ``model.layers`` inside a Hugging Face decoder), and the modules
around them. Work done outside every unit (functional code in the top ``forward``, the loss) goes to the
nearest unit that ran before it. Numbers are per sample of the example batch (its first dimension), at the
example's sequence length: trace with the length you will train at.

A traced model has no tensor-parallel plan the planner knows (``tp_divisors`` is empty): predict dp, ZeRO
and pipeline layouts for it.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .layers import Gemm, Layer

__all__ = ["trace_fields", "find_units"]

_aten = torch.ops.aten
_GEMMS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_ATTENTION = {getattr(_aten, n).default for n in ("_scaled_dot_product_flash_attention",
                                                  "_scaled_dot_product_efficient_attention",
                                                  "_scaled_dot_product_flash_attention_for_cpu") if hasattr(_aten, n)}


def find_units(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of the units of ``module`` in registration order (see module doc)."""
    if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2:
        return [(f"{prefix}{name}", child) for name, child in module.named_children()]
    if not any(isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) >= 2 for m in module.modules()):
        return [(prefix.rstrip(".") or "model", module)]
    units: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        units += find_units(child, f"{prefix}{name}.")
    return units


class _Recorder(TorchDispatchMode):
    """Collects GEMM shapes and memory-bound traffic per unit while the forward runs on meta tensors."""

    def __init__(self, params: set[int]) -> None:
        super().__init__()
        self.params, self.unit = params, 0
        self.gemms: dict[int, list[Gemm]] = {}
        self.traffic: dict[int, float] = {}
        self.ops: dict[int, int] = {}

    def _is_param(self, t: Any) -> bool:
        while isinstance(t, torch.Tensor):
            if id(t) in self.params:
                return True
            t = t._base
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func in _GEMMS:
            a, b = (args[1], args[2]) if func in (_aten.addmm.default, _aten.baddbmm.default) else (args[0], args[1])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.gemms.setdefault(self.unit, []).append(
                Gemm(str(func.__name__), a.shape[-2], a.shape[-1], b.shape[-1], batch=batch,
                     weight=self._is_param(b) or self._is_param(a)))
        elif func in _ATTENTION:
            q, k = args[0], args[1]  # (b, heads, s, d)
            bh, s, d = q.shape[0] * q.shape[1], q.shape[2], q.shape[3]
            causal = bool(kwargs.get("is_causal", False)) if kwargs else False
            self.gemms.setdefault(self.unit, []).extend(
                [Gemm("scores", s, d, k.shape[2], batch=bh, weight=False, causal=causal),
                 Gemm("context", s, k.shape[2], d, batch=bh, weight=False, causal=causal)])
        elif not _is_view(func, out, tensors):
            outs = out if isinstance(out, (tuple, list)) else [out]
            moved = sum(t.numel() * t.element_size() for t in tensors + [o for o in outs if isinstance(o, torch.Tensor)])
            self.traffic[self.unit] = self.traffic.get(self.unit, 0.0) + moved
            self.ops[self.unit] = self.ops.get(self.unit, 0) + 1
        return out


class _FusedAttention(TorchFunctionMode):
    """Costs ``F.scaled_dot_product_attention`` as the fused kernel it is on real devices (meta tensors would take
    the unfused math path): two attention GEMMs, and q, k, v, the output and a per-row statistic kept."""

    def __init__(self, rec: _Recorder, saved: dict[int, float]) -> None:
        super().__init__()
        self.rec, self.saved = rec, saved

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]  # (b, heads, s, d)
        bh, s, d = q.numel() // (q.shape[-2] * q.shape[-1]), q.shape[-2], q.shape[-1]
        causal = bool(kwargs.get("is_causal", args[5] if len(args) > 5 else False))
        unit = self.rec.unit
        self.rec.gemms.setdefault(unit, []).extend(
            [Gemm("scores", s, d, k.shape[-2], batch=bh, weight=False, causal=causal),
             Gemm("context", s, k.shape[-2], v.shape[-1], batch=bh, weight=False, causal=causal)])
        out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)
        kept = sum(t.numel() * t.element_size() for t in (q, k, v, out)) + bh * s * 4
        self.saved[unit] = self.saved.get(unit, 0.0) + kept
        return out


def _is_view(func: Any, out: Any, tensors: list[torch.Tensor]) -> bool:
    # aliasing ops (view, transpose, slice, expand, ...) move no bytes; their schema says they alias an input
    schema = getattr(func, "_schema", None)
    return bool(schema and schema.returns and any(r.alias_info is not None for r in schema.returns))


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    return x


def trace_fields(module: nn.Module, example_inputs: Any, *, loss_fn: Callable[..., Any] | None = None) -> dict[str, Any]:
    """``ModelSpec`` keyword arguments for ``module`` run on ``example_inputs`` (a tuple of positional inputs or
    a dict of keyword inputs); ``loss_fn(output)`` if given runs as part of the last unit."""
    if any(p.device.type != "meta" for p in module.parameters()):
        module = copy.deepcopy(module).to("meta")
    args = _to_meta(example_inputs)
    args, kwargs = (((), args) if isinstance(args, dict) else (tuple(args) if isinstance(args, (list, tuple)) else (args,), {}))
    first = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError("ModelSpec.trace needs at least one tensor input with a batch dimension first")
    batch = first.shape[0]
    seq = first.shape[1] if first.dim() >= 2 and not first.is_floating_point() else 1
    units = find_units(module)
    params = {id(p) for p in module.parameters()}
    rec = _Recorder(params)
    saved: dict[int, float] = {}
    outputs: dict[int, int] = {}
    handles = []
    for i, (_, unit) in enumerate(units):
        def enter(_m: Any, _a: Any, i: int = i) -> None:
            rec.unit = i

        def leave(_m: Any, _a: Any, out: Any, i: int = i) -> None:
            t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "last_hidden_state", out)
            outputs[i] = t.numel() // batch if isinstance(t, torch.Tensor) else 0
        handles += [unit.register_forward_pre_hook(enter), unit.register_forward_hook(leave)]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not rec._is_param(t):
            saved[rec.unit] = saved.get(rec.unit, 0.0) + t.numel() * t.element_size()
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), rec, _FusedAttention(rec, saved):
            out = module(*args, **kwargs)
            if loss_fn is not None:
                loss_fn(out)
    finally:
        for h in handles:
            h.remove()
    return _layers(units, rec, saved, outputs, batch, seq)


def _layers(units: list[tuple[str, nn.Module]], rec: _Recorder, saved: dict[int, float], outputs: dict[int, int],
            batch: int, seq: int) -> dict[str, Any]:
    seen: dict[int, str] = {}
    layers = []
    for i, (name, unit) in enumerate(units):
        own = shared = 0
        tied = ""
        for p in unit.parameters():
            if id(p) in seen:
                shared += p.numel()
                tied = seen[id(p)]
            else:
                seen[id(p)] = name
            own += p.numel()
        gemms = tuple(Gemm(g.name, g.rows, g.k, g.n, batch=g.batch, weight=g.weight, causal=g.causal)
                      for g in rec.gemms.get(i, []))
        # per sample: the batch divides the GEMMs' rows (linear layers) or their batch count (attention cores)
        gemms = tuple(_per_sample(g, batch) for g in gemms)
        kind = "block" if i not in (0, len(units) - 1) else ("embedding" if i == 0 else "head")
        # saved bytes → elements of 4 bytes (the spec counts elements; traced numbers are in the traced dtype)
        layers.append(Layer(name, kind, params=own, gemms=gemms, ew_rep=rec.traffic.get(i, 0.0) / 4 / batch,
                            ops=rec.ops.get(i, 0), act_rep=saved.get(i, 0.0) / 4 / batch, hidden=outputs.get(i, 0),
                            tied=tied, shared=shared, largest=max((p.numel() for p in unit.parameters()), default=0)))
    return {"seq_len": seq, "layers": tuple(layers)}


def _per_sample(g: Gemm, batch: int) -> Gemm:
    if g.batch % batch == 0 and g.batch >= batch:
        return Gemm(g.name, g.rows, g.k, g.n, batch=g.batch // batch, weight=g.weight, causal=g.causal)
    return Gemm(g.name, g.rows / batch, g.k, g.n, batch=g.batch, weight=g.weight, causal=g.causal)  # type: ignore[arg-type]
