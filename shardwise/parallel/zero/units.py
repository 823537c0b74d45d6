"""ZeRO-3 units: which parameters each unit gathers, split into a trainable and a frozen flat group.

A unit (a list of module names, ``stage3.py``) owns the parameters used by exactly its modules; the rest unit
owns every other one (embeddings, ties). Each unit's parameters become at most two ``FlatGroup`` s:

- the *trainable* group (``requires_grad=True``): gathered, reduce-scattered, stepped by the optimizer;
- the *frozen* group (``requires_grad=False``, same dtype as the trainable ones): sharded and gathered like
  the trainable group, but it has no gradient, no reduce-scatter and no optimizer state. A frozen base under
  LoRA therefore costs ``1/N`` of its bytes per rank and nothing else.

Frozen parameters of another dtype (e.g. an integer quantised base) are not sharded: they stay whole on every
rank, as any tensor no group holds. Pure (the groups are built by the caller's ``make_group``).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch.nn as nn

from ... import comm
from .flat import FlatGroup

__all__ = ["Unit", "UnitHandle", "assign", "build_units"]

Named = list[tuple[str, nn.Parameter]]


class UnitHandle:
    """The in-flight gathers of one unit's groups (``Unit.start_gather``)."""

    def __init__(self, pairs: list[tuple[FlatGroup, comm.Handle]]) -> None:
        self.pairs = pairs


class Unit:
    """One stage-3 unit's flat groups: ``trainable`` and ``frozen``, either may be ``None`` (not both). The
    unit counts as gathered when every group is; gathering gathers the groups that are not."""

    def __init__(self, trainable: FlatGroup | None, frozen: FlatGroup | None) -> None:
        assert trainable is not None or frozen is not None, "a unit holds at least one group"
        self.trainable, self.frozen = trainable, frozen
        self.parts = [g for g in (trainable, frozen) if g is not None]

    @property
    def gathered(self) -> bool:
        return all(g.gathered for g in self.parts)

    @gathered.setter
    def gathered(self, value: bool) -> None:
        for g in self.parts:
            g.gathered = value

    def start_gather(self) -> UnitHandle:
        """Start the all-gather of every group not gathered (collective: every rank's unit is in the same
        state, since the same hooks freed the same parts)."""
        return UnitHandle([(g, g.start_gather()) for g in self.parts if not g.gathered])

    def finish_gather(self, handle: UnitHandle) -> None:
        for g, h in handle.pairs:
            g.finish_gather(h)

    def free(self) -> None:
        """Free every gathered group (local)."""
        for g in self.parts:
            if g.gathered:
                g.free()

    def free_frozen(self) -> None:
        if self.frozen is not None and self.frozen.gathered:
            self.frozen.free()

    def free_trainable(self) -> None:
        if self.trainable is not None and self.trainable.gathered:
            self.trainable.free()


def assign(module: nn.Module, unit_modules: Sequence[Sequence[nn.Module]], params: Named) -> tuple[list[Named], Named]:
    """``(per_unit, rest)``: each parameter of ``params`` goes to the one unit whose modules use it, or to the
    rest when none or several do (a tie). Pure."""
    owners: dict[int, set[int]] = {}
    for k, mods in enumerate(unit_modules):
        for m in mods:
            for p in m.parameters():
                owners.setdefault(id(p), set()).add(k)
    per_unit: list[Named] = [[] for _ in unit_modules]
    rest: Named = []
    for n, p in params:
        ks = owners.get(id(p), set())
        (per_unit[next(iter(ks))] if len(ks) == 1 else rest).append((n, p))
    return per_unit, rest


def build_units(module: nn.Module, unit_modules: Sequence[Sequence[nn.Module]], trainable: Named, frozen: Named,
                make_group: Callable[[Named], FlatGroup]) -> tuple[list[Unit], list[list[nn.Module]], bool]:
    """``(units, their modules, has_rest)``: the rest unit first (when it holds anything), then every unit that
    holds a trainable or a frozen parameter, in forward order; each with its trainable and frozen groups. Frozen
    groups' masters do not require grad (no optimizer ever sees them)."""
    t_units, t_rest = assign(module, unit_modules, trainable)
    f_units, f_rest = assign(module, unit_modules, frozen)

    def unit(t: Named, f: Named) -> Unit:
        frozen_group = make_group(f) if f else None
        if frozen_group is not None:
            frozen_group.master.requires_grad_(False)
        return Unit(make_group(t) if t else None, frozen_group)
    has_rest = bool(t_rest or f_rest)
    units = [unit(t_rest, f_rest)] if has_rest else []
    kept = [list(mods) for mods, t, f in zip(unit_modules, t_units, f_units) if t or f]
    units += [unit(t, f) for t, f in zip(t_units, f_units) if t or f]
    return units, kept, has_rest
