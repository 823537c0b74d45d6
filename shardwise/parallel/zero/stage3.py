"""ZeRO stage 3: gather a unit's parameters just before they are used, free them right after.

Units (plain data: lists of module names) default to each element of ``model.blocks`` plus "the rest" —
every parameter not owned by exactly one block unit (embeddings, final norm, head, and any parameter
shared between units, e.g. tied weights), so a tie never crosses a unit boundary.

Schedule of one step, for units ``rest, b_0 .. b_{n-1}``:

- forward: the root's forward pre-hook gathers ``rest`` (kept until backward ends: the embedding runs
  first and the tied head last). Block ``b_k``'s forward pre-hook waits for its gather (prefetched by
  ``b_{k-1}``) and starts ``b_{k+1}``'s (prefetch); its forward hook frees ``b_k``.
- backward: a pre-hook on the grad_fn of ``b_k``'s output(s) — the first node of ``b_k``'s backward —
  gathers ``b_k`` again and prefetches ``b_{k-1}``. We chose the grad_fn pre-hook over saved-tensor hooks
  because it fires exactly once per unit per backward, before any node of the unit, and also works when
  the unit is activation-checkpointed (its recomputation then sees the gathered parameters).
  After ``b_k``'s gradients are all accumulated the reducer flattens them, frees the unit's trainable group and
  starts the reduce-scatter; ``rest`` is reduced and freed when backward ends.
- frozen parameters (``units.py``: each unit's frozen group, gathered with it, never reduced): a node that needs a
  frozen weight in backward either leads to a trainable parameter of the unit or to the unit's input, so the
  frozen group of ``b_k`` is freed once both happened — the trainable group launched (or there is none) and the
  backward reached ``b_{k-1}`` (its pre-hook) — or when backward ends.

Per step: ``1 + 2n`` all-gathers (``rest`` once, each block in forward and in backward) and ``n + 1``
reduce-scatters. Hooks that fire during backward (a recomputation calling a block through ``__call__``)
neither prefetch nor free. Every rank must run the same forward/backward sequence (collective hooks).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from .units import Unit, UnitHandle

__all__ = ["default_units", "Stage3Runtime", "unit_module"]


def default_units(model: nn.Module) -> list[list[str]]:
    """``[[block names...] per block]`` for every element of ``ModuleList`` s named ``blocks`` (outermost);
    the rest unit is implicit. Returns ``[]`` when there are none (one unit: the whole model)."""
    units: list[list[str]] = []
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] == "blocks":
            if any(name.startswith(u[0] + ".") for u in units):
                continue
            units.extend([f"{name}.{i}" if name else str(i)] for i in range(len(m)))
    return units


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class Stage3Runtime:
    """Hooks and gather state for stage 3. ``units[0]`` is the rest unit (``has_rest``; else a unit like
    the others), ``units[first:]`` the units whose modules are ``unit_modules`` (in forward order)."""

    def __init__(self, root: nn.Module, units: list[Unit], unit_modules: list[list[nn.Module]],
                 has_rest: bool, prefetch: bool = True) -> None:
        self.units, self.prefetch, self.has_rest = units, prefetch, has_rest
        self.first = 1 if has_rest else 0
        self.pending: dict[int, UnitHandle] = {}
        # this backward: units whose trainable group was launched, units whose input gradient is being computed
        self.reduced: set[int] = set()
        self.below: set[int] = set()
        self.hook_handles = [root.register_forward_pre_hook(self._root_pre),
                             root.register_forward_hook(self._root_post)]
        for k, modules in enumerate(unit_modules, start=self.first):
            first, last = modules[0], modules[-1]
            self.hook_handles.append(first.register_forward_pre_hook(self._pre_forward_for(k)))
            self.hook_handles.append(last.register_forward_hook(self._post_forward_for(k)))

    # -- gathering ------------------------------------------------------------------------------------
    def ensure(self, k: int) -> None:
        """Make unit ``k`` gathered (waiting for its prefetch, or gathering now). Collective."""
        handle = self.pending.pop(k, None)
        if handle is None:
            if self.units[k].gathered:
                return
            handle = self.units[k].start_gather()
        self.units[k].finish_gather(handle)

    def start(self, k: int) -> None:
        """Prefetch unit ``k`` (asynchronous all-gather) unless it is gathered or on its way."""
        if self.prefetch and 0 <= k < len(self.units) and k not in self.pending and not self.units[k].gathered:
            self.pending[k] = self.units[k].start_gather()

    def free(self, k: int) -> None:
        if k not in self.pending:
            self.units[k].free()

    def launched(self, k: int) -> None:
        """Unit ``k``'s trainable group started its reduce-scatter: free it, and its frozen group too if the
        backward already went below the unit."""
        if k in self.pending:
            return
        self.units[k].free_trainable()
        self.reduced.add(k)
        if k in self.below:
            self.units[k].free_frozen()

    def _went_below(self, k: int) -> None:
        """The backward reached the unit before ``k``: ``k``'s input gradient is complete."""
        self.below.add(k)
        unit = self.units[k]
        if (unit.trainable is None or k in self.reduced) and k not in self.pending:
            unit.free_frozen()

    def free_all(self) -> None:
        """Finish any stray prefetch and free every unit (end of backward; local after the waits)."""
        for k in list(self.pending):
            self.units[k].finish_gather(self.pending.pop(k))
        for k in range(len(self.units)):
            self.free(k)
        self.reduced.clear()
        self.below.clear()

    # -- hooks ------------------------------------------------------------------------------------------
    def _root_pre(self, _module: nn.Module, _args: Any) -> None:
        if _in_backward() or not self.has_rest:
            return
        # The parameters changed since the last gather only through a step, but re-gathering the rest
        # unit every forward keeps the rule simple and identical on every rank.
        self.units[0].gathered = self.units[0].gathered and 0 in self.pending
        self.ensure(0)

    def _root_post(self, _module: nn.Module, _args: Any, _out: Any) -> None:
        if not torch.is_grad_enabled() and not _in_backward():
            self.free_all()  # no backward will follow

    def _pre_forward_for(self, k: int):
        def hook(_module: nn.Module, _args: Any) -> None:
            self.ensure(k)
            if not _in_backward():
                self.start(k + 1)
        return hook

    def _post_forward_for(self, k: int):
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if _in_backward():
                return
            self.free(k)
            if torch.is_grad_enabled():
                fns = {id(t.grad_fn): t.grad_fn for t in tree_flatten(output)[0]
                       if isinstance(t, torch.Tensor) and t.grad_fn is not None}
                fired = [False]
                for fn in fns.values():
                    fn.register_prehook(self._pre_backward_for(k, fired))
        return hook

    def _pre_backward_for(self, k: int, fired: list[bool]):
        def hook(_grads: Any) -> None:
            if fired[0]:
                return
            fired[0] = True
            self.ensure(k)
            if k + 1 < len(self.units):
                self._went_below(k + 1)
            if k - 1 >= self.first:
                self.start(k - 1)
        return hook


def unit_module(model: nn.Module, name: str) -> nn.Module:
    """The module ``name`` of a stage-3 unit; ``ValueError`` when there is none, or it is a container that is never
    called (its hooks would never gather)."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"stage-3 unit names a module {name!r} that the model does not have; use names "
                         f"from model.named_modules(), e.g. 'blocks.0'") from None
    if type(module).forward is nn.Module.forward:
        # Units are gathered by forward hooks; a container (ModuleList/ModuleDict) is never called.
        raise ValueError(f"stage-3 unit module {name!r} is a {type(module).__name__}, which is never called, "
                         f"so its hooks would never gather it; list the modules inside it, e.g. "
                         f"[['{name}.0'], ['{name}.1'], ...]")
    return module
