"""Sequence-parallel gradient regions: one all-reduce per region of replicated parameters, not one per parameter.

With sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", §4.2.2) the norms, the row-parallel biases and the position embedding are replicated (``B``) but act on
this rank's sequence slice, so each rank's gradient is a partial sum (``P``) that must be all-reduced over tp.
Each such message is tiny (a norm weight is ``h`` floats) and latency-bound, so the parameters are grouped into
*regions* and each region's gradients cross the wire as one flat buffer:

- a region is the outermost element of an ``nn.ModuleList``/``nn.ModuleDict`` holding the module (a transformer
  block: its two norms and two row biases), else the module itself (``ln_f``, ``wpe``);
- when the first member module of a region runs a forward with grad enabled, the region's parameters pass
  through ``SumOverAxis`` — the identity in forward — and every member's forward uses those outputs in place
  of its parameters (swapped in for the member's forward, restored after it);
- autograd calls ``SumOverAxis.backward`` once, after every use in the region has produced its gradient; it
  all-reduces them as one flat buffer per dtype and returns the sums, which autograd accumulates into
  ``.grad`` as usual. Whatever reads ``.grad`` or hooks its accumulation (data parallelism's reducer, ZeRO's,
  the pipeline's gradient sync, clipping, accumulation over several backwards) sees tp-summed values.

Activation checkpointing: a member called again after it already used the region's outputs starts a new
application. A non-reentrant recomputation therefore builds a fresh, never-differentiated node (no second
all-reduce); a reentrant one (whose forward ran without grad) is differentiated once, as it should be.
ZeRO stage 3: the outputs are views of the parameters as they are when the first member runs (inside the
block's forward, after ZeRO gathered it), so a region must lie inside one ZeRO unit; if some of its parameters
are not materialised then, the member's own parameters form the region for that call (one all-reduce per
member module instead — still correct). The members' swap-in pre-hooks are kept behind every other pre-hook
(``hooks_last``), so they run after ZeRO's gathering pre-hooks although those are registered later.

The all-reduce is synchronous: it runs once per region, after the region's backward, and is not overlapped
with the previous region's backward (the summed values must exist before autograd accumulates them).

Each such parameter carries ``_shardwise_partial_axis`` (the tp axis): code that computes its gradient outside
autograd (a closed-form weight gradient) must sum it over that axis itself.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn

from ...comm.collectives import all_reduce
from ...mesh import Mesh

__all__ = ["SumOverAxis", "GradRegion", "region_of", "build_regions"]


class SumOverAxis(torch.autograd.Function):
    """Identity on tensors ``t_0 .. t_{k-1}`` in forward (views); backward sums their gradients over ``axis``
    with one all-reduce per dtype of a flat buffer (zeros stand in for a missing gradient so that every rank
    sends the same bytes). A gradient that was missing locally stays ``None``. Collective in backward."""

    @staticmethod
    def forward(ctx: Any, mesh: Mesh, axis: str, algorithm: str, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.mesh, ctx.axis, ctx.algorithm = mesh, axis, algorithm
        ctx.metas = [(t.shape, t.dtype, t.device) for t in tensors]
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        return (None, None, None, *sum_flat(list(grads), ctx.metas, ctx.mesh, ctx.axis, ctx.algorithm))


def sum_flat(grads: list[torch.Tensor | None], metas: Sequence[tuple], mesh: Mesh, axis: str,
             algorithm: str = "native") -> list[torch.Tensor | None]:
    """All-reduce (sum) ``grads`` over ``axis`` as one flat buffer per dtype (in first-seen order); returns
    per-tensor views of the summed buffers (``None`` where the gradient was ``None``). Collective."""
    out: list[torch.Tensor | None] = [None] * len(grads)
    dtypes = list(dict.fromkeys(m[1] for m in metas))
    for dtype in dtypes:
        idx = [i for i, m in enumerate(metas) if m[1] == dtype]
        # (Σ numel,) = [g_0.flatten() | g_1.flatten() | ...]
        flat = torch.cat([grads[i].reshape(-1) if grads[i] is not None
                          else torch.zeros(metas[i][0].numel(), dtype=dtype, device=metas[i][2]) for i in idx])
        all_reduce(flat, mesh, axis, op="sum", algorithm=algorithm)
        pos = 0
        for i in idx:
            n = metas[i][0].numel()
            if grads[i] is not None:
                out[i] = flat[pos:pos + n].view(metas[i][0])
            pos += n
    return out


class GradRegion:
    """The partial-gradient parameters of one region and the member modules that use them (see module doc).
    A parameter is addressed by its slot ``(owner module, attribute name)`` and read from there at each
    forward (so a parameter replaced after ``parallelize``, e.g. by ``module.to(...)``, is the one summed)."""

    def __init__(self, name: str, mesh: Mesh, axis: str, algorithm: str = "native") -> None:
        self.name, self.mesh, self.axis, self.algorithm = name, mesh, axis, algorithm
        self.slots: list[tuple[nn.Module, str, torch.Size]] = []  # (owner, attr, local shape at parallelize)
        self.members: dict[int, list[int]] = {}  # id(member module) -> indices into slots
        self._active: dict[int, torch.Tensor] | None = None  # id(param) -> its SumOverAxis output
        self._used: set[int] = set()  # members that used _active
        self._saved: dict[int, list[list[tuple[nn.Module, str, torch.Tensor]]]] = {}  # swapped-out params
        self._pre_hooks: list[tuple[nn.Module, Any]] = []

    @property
    def params(self) -> list[torch.Tensor]:
        """The region's parameters as they are now, each once (a parameter in two slots is one)."""
        return list({id(p): p for p in (owner._parameters[attr] for owner, attr, _ in self.slots)}.values())

    def add_member(self, member: nn.Module, slots: list[tuple[nn.Module, str]]) -> None:
        """Register ``member`` (a module whose forward reads the parameters at ``slots``) and hook it. Local."""
        entries = []
        for owner, attr in slots:
            p = owner._parameters[attr]
            assert isinstance(p, nn.Parameter), (self.name, attr)
            p._shardwise_partial_axis = self.axis  # type: ignore[attr-defined]  # its local gradient is P over it
            k = next((i for i, (o, a, _) in enumerate(self.slots) if o is owner and a == attr), None)
            if k is None:
                k = len(self.slots)
                self.slots.append((owner, attr, p.shape))
            entries.append(k)
        self.members[id(member)] = entries
        self._pre_hooks.append((member, member.register_forward_pre_hook(self._swap_in)))
        member.register_forward_hook(self._swap_out, always_call=True)

    def hooks_last(self) -> None:
        """Move the members' swap-in pre-hooks behind every other pre-hook, so that they see the parameters
        as the forward will (ZeRO-3 registers its gathering pre-hooks after ``parallelize``). Local."""
        for member, handle in self._pre_hooks:
            hooks = member._forward_pre_hooks
            if handle.id in hooks and next(reversed(hooks)) != handle.id:
                hooks.move_to_end(handle.id)

    def _outputs(self, member: nn.Module) -> dict[int, torch.Tensor]:
        """The ``SumOverAxis`` outputs ``member`` should use, applying the node when a new pass starts."""
        if self._active is not None and id(member) not in self._used:
            self._used.add(id(member))
            return self._active
        if any(owner._parameters[attr].shape != shape for owner, attr, shape in self.slots):
            # Some parameter is not materialised (a ZeRO-3 unit finer than the region): this member alone.
            self._active = None
            mine = [self.slots[k] for k in self.members[id(member)]]
            return self._apply([owner._parameters[attr] for owner, attr, _ in mine])
        self._active, self._used = self._apply(self.params), {id(member)}
        return self._active

    def _apply(self, params: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        live = list({id(p): p for p in params if p.requires_grad}.values())
        if not live:
            return {}
        outs = SumOverAxis.apply(self.mesh, self.axis, self.algorithm, *live)
        return {id(p): o for p, o in zip(live, outs)}

    def _swap_in(self, member: nn.Module, _args: Any) -> None:
        self.hooks_last()  # for the next call (a pre-hook added later runs after this one this time)
        if not torch.is_grad_enabled():
            return
        outs = self._outputs(member)
        saved = []
        for k in self.members[id(member)]:
            owner, attr, _ = self.slots[k]
            p = owner._parameters[attr]
            if id(p) in outs:
                saved.append((owner, attr, p))
                owner._parameters[attr] = outs[id(p)]  # read by the member's forward as owner.<attr>
        self._saved.setdefault(id(member), []).append(saved)

    def _swap_out(self, member: nn.Module, _args: Any, _out: Any) -> None:
        stack = self._saved.get(id(member))
        if stack:
            for owner, attr, p in stack.pop():
                owner._parameters[attr] = p


def region_of(model: nn.Module, name: str) -> str:
    """The region of module ``name``: the outermost element of a ``ModuleList``/``ModuleDict`` containing it,
    else ``name`` itself. Pure."""
    parts = name.split(".")
    for i in range(1, len(parts)):
        if isinstance(model.get_submodule(".".join(parts[:i])), (nn.ModuleList, nn.ModuleDict)):
            return ".".join(parts[:i + 1])
    return name


def build_regions(model: nn.Module, members: list[tuple[str, nn.Module, list[str]]], mesh: Mesh,
                  axis: str, algorithm: str = "native") -> list[GradRegion]:
    """Group ``(module name, module, names of its partial-gradient parameters)`` into regions (in first-member
    order) and hook every member. Local."""
    regions: dict[str, GradRegion] = {}
    for name, module, pnames in members:
        if not pnames:
            continue
        key = region_of(model, name)
        region = regions.setdefault(key, GradRegion(key, mesh, axis, algorithm))
        slots = []
        for pname in pnames:
            owner_name, _, attr = pname.rpartition(".")
            slots.append((module.get_submodule(owner_name) if owner_name else module, attr))
        region.add_member(module, slots)
    return list(regions.values())
