"""ZeRO-3 inside a pipeline: each rank holds 1/dp of its stages' parameters and gathers a unit only while it runs.

The gathering policy (the memory/communication trade-off, chosen per unit of the stage):

* **units** are the pipeline's own (``stage.Unit``: the embedding unit, each block, the final unit). Each is at most
  two flat groups sharded over dp (``zero.flat.FlatGroup``, ``sharded_params=True``; ``zero.units.Unit`` pairs them),
  cut from meta so no rank ever holds a whole stage: its trainable parameters, and its frozen ones
  (``requires_grad=False``, of the trainable parameters' dtype: a LoRA base) — gathered and freed with the unit
  everywhere below, never reduced, no optimizer state, so a frozen base costs ``1/dp`` of its bytes per rank;
* **forward** (every micro-batch): a unit is all-gathered just before it runs — the next unit's gather is started
  (prefetch) as this one starts — and freed as soon as it returns (``reshard_after_forward``);
* **backward** (every micro-batch): a pre-hook on the first autograd node of the unit's backward gathers it again,
  prefetches the unit before it and frees the unit after it (whose backward is over by then). Recomputation
  (activation checkpointing) runs inside that window, so it sees the gathered unit. A unit whose output needs no
  gradient (a frozen embedding fed token ids) has no backward and is not prefetched for one;
* **zero-bubble ``W``**: the closed-form weight gradients of ``Linear`` and ``LayerNorm`` read only the kept input
  and the output gradient, so they gather nothing; any other module's local backward gathers its unit first; a
  stage that fell back to differentiating itself whole (activation checkpointing) gathers all its units for W;
* **held**: parameters used by two units of this rank, or tied to another pipeline rank (the embedding and the
  head), form one group gathered when the step starts and freed after its reduction — the tied-gradient exchange
  and every micro-batch need them. Frozen ones used by two units of this rank form a frozen held group; a frozen
  tie exchanges no gradient (``tied.py``), so it stays in its unit's frozen group;
* **gradients** accumulate over the step's micro-batches in each unit's full flat buffer (allocated when the
  unit's first backward starts) and are reduce-scattered **once per step per stage**, when the stage's last
  backward is done (``grad_sync.DpGradSync``), then freed.

Per step and unit: ``2m`` all-gathers (``3m`` with a W that needs the parameters) of the unit's parameters and one
reduce-scatter of its trainable gradients (none of its frozen group), for ``m`` micro-batches; memory: the parameter
shards, at most two gathered units plus the held group, and the gradients of the stage's units once their first
backward has run. FSDP2's
``reshard_after_forward=False`` (what torchtitan uses inside pipelines) would instead keep a stage gathered from
its first forward to its last backward: ``2`` gathers per step instead of ``2m``, but a whole stage in memory.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..common.expert_tag import is_expert_param
from ..zero.flat import FlatGroup
from ..zero.units import Unit
from .grad_sync import DpGradSync

__all__ = ["unit_plans", "shared_parameters", "frozen_plans", "PipelineStage3"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _unit_named(unit: Any) -> list[tuple[str, nn.Parameter]]:
    """The unit's parameters, each once, under their names in the original model."""
    seen: dict[int, tuple[str, nn.Parameter]] = {}
    for name, m in unit.modules:
        for n, q in m.named_parameters():
            seen.setdefault(id(q), (f"{name}.{n}", q))
    return list(seen.values())


def _unit_params(unit: Any) -> list[nn.Parameter]:
    return [q for _, q in _unit_named(unit)]


def shared_parameters(stages: dict[int, Any]) -> set[int]:
    """Ids of parameters used by more than one unit of this rank's stages: they go to the held group. Pure."""
    count: dict[int, int] = {}
    for stage in stages.values():
        for unit in stage.units:
            for q in _unit_params(unit):
                count[id(q)] = count.get(id(q), 0) + 1
    return {k for k, n in count.items() if n > 1}


def unit_plans(stage: Any, kept: list[nn.Parameter]) -> tuple[list[list[int]], list[int]]:
    """``(plan, unit of each plan entry)``: indices into ``kept`` (the stage's bucketed parameters, in order) of each
    unit's group, for the units that own any. Every kept parameter lands in exactly one unit. Pure."""
    where = {id(q): i for i, q in enumerate(kept)}
    plan, owner, taken = [], [], set()
    for k, unit in enumerate(stage.units):
        idx = sorted(where[id(q)] for q in _unit_params(unit) if id(q) in where and id(q) not in taken)
        taken.update(id(kept[i]) for i in idx)
        if idx:
            plan.append(idx)
            owner.append(k)
    assert len(taken) == len(kept), "every kept parameter of a stage belongs to one of its units"
    return plan, owner


Key = tuple[int, int]
Named = list[tuple[str, nn.Parameter]]


def frozen_plans(stages: dict[int, Any], dtype: torch.dtype) -> tuple[dict[Key, Named], Named]:
    """``({(stage, unit): its frozen parameters}, held)``: the frozen parameters of ``dtype`` (not expert pieces) of
    this rank's stages, each under the first unit using it, or in ``held`` when two units of this rank use it (as
    the trainable held group). Another dtype (an integer quantised base) stays whole, as in ``sw.zero``. Pure."""
    shared = shared_parameters(stages)
    seen: set[int] = set()
    per_unit: dict[Key, Named] = {}
    held: Named = []
    for s in sorted(stages):
        for k, unit in enumerate(stages[s].units):
            for n, q in _unit_named(unit):
                if q.requires_grad or id(q) in seen or is_expert_param(q) or q.dtype != dtype:
                    continue
                seen.add(id(q))
                (held if id(q) in shared else per_unit.setdefault((s, k), [])).append((n, q))
    return per_unit, held


def _reference_dtype(sync: DpGradSync, stages: dict[int, Any]) -> torch.dtype | None:
    """The dtype frozen parameters are sharded in: the trainable ones' (their masters'), else the first floating
    frozen parameter's (a stage that trains nothing). Every dp replica of a stage computes the same. Pure."""
    if sync.buckets:
        return sync.buckets[0].group.master.dtype
    floats = [q.dtype for s in sorted(stages) for q in stages[s].parameters() if q.is_floating_point()]
    return floats[0] if floats else None


class PipelineStage3:
    """Gathers and frees the units of this rank's stages as the schedule runs them (see module doc)."""

    def __init__(self, sync: DpGradSync, stages: dict[int, Any], owners: dict[int, list[int]]) -> None:
        self.sync = sync
        trainable: dict[Key, FlatGroup] = {}
        for s in sorted(stages):
            mine = [b.group for b in sync.buckets if b.stage == s]
            trainable.update({(s, k): g for k, g in zip(owners.get(s, []), mine)})
        frozen, frozen_held = self._frozen_groups(sync, stages)
        self.frozen_groups: list[FlatGroup] = [*frozen.values(), *frozen_held]
        """The frozen parameters' shards (gathered with their unit, or held): never reduced, in no optimizer."""
        self.groups: dict[Key, Unit] = {key: Unit(trainable.get(key), frozen.get(key))
                                        for key in sorted({*trainable, *frozen})}
        self.held: list[FlatGroup] = [*(b.group for b in sync.buckets if b.stage is None), *frozen_held]
        self.of_module = {id(sub): key for key in self.groups  # every submodule: W names leaf modules
                          for _, m in stages[key[0]].units[key[1]].modules for sub in m.modules()}
        self.pending: dict[int, Any] = {}  # id(unit or held group) -> its in-flight gather
        self._entered: Key | None = None
        self._no_backward: set[Key] = set()  # units whose output needs no gradient (a frozen embedding's)
        for s, stage in stages.items():
            stage.unit_hook = self

    @staticmethod
    def _frozen_groups(sync: DpGradSync, stages: dict[int, Any]) -> tuple[dict[Key, FlatGroup], list[FlatGroup]]:
        """Each unit's frozen group and the frozen held group, cut from meta like the trainable ones (no rank holds
        a frozen stage whole). Their masters do not require grad: no optimizer ever sees them."""
        dtype = _reference_dtype(sync, stages)
        per_unit, held = frozen_plans(stages, dtype) if dtype is not None else ({}, [])

        def group(named: Named) -> FlatGroup:
            g = FlatGroup([n for n, _ in named], [q for _, q in named], sync.mesh, sync.axis,
                          compute_dtype=sync.compute_dtype or named[0][1].dtype, sharded_params=True,
                          algorithm=sync.algorithm)
            g.master.requires_grad_(False)
            return g
        return {key: group(named) for key, named in per_unit.items()}, ([group(held)] if held else [])

    @property
    def flat_groups(self) -> list[FlatGroup]:
        """Every flat group holding parameter values on this rank: the held ones, then each unit's parts."""
        return [*self.held, *(g for u in self.groups.values() for g in u.parts)]

    # -- gather / free ----------------------------------------------------------------------------------
    def ensure(self, g: Unit | FlatGroup) -> None:
        """Make ``g`` gathered (waiting for its prefetch, or gathering now). Collective over dp."""
        handle = self.pending.pop(id(g), None)
        if handle is None:
            if g.gathered:
                return
            handle = g.start_gather()
        g.finish_gather(handle)

    def _prefetch(self, key: Key) -> None:
        u = self.groups.get(key)
        if u is not None and not u.gathered and id(u) not in self.pending:
            self.pending[id(u)] = u.start_gather()

    def _free(self, key: Key) -> None:
        u = self.groups.get(key)
        if u is not None and id(u) not in self.pending:
            u.free()

    def action_done(self, stage: int) -> None:
        """After any action of ``stage``: no unit of it stays gathered (a stray prefetch is finished first)."""
        for (s, k), u in self.groups.items():
            if s == stage:
                if id(u) in self.pending:
                    u.finish_gather(self.pending.pop(id(u)))
                self._free((s, k))
        self._entered = None

    def hold(self) -> None:
        """Gather the held group(s): a step or an evaluation starts. Collective over dp."""
        for g in self.held:
            self.ensure(g)

    def release(self) -> None:
        for g in self.held:
            if g.gathered:
                g.free()

    @contextmanager
    def gathered(self) -> Iterator[None]:
        """Every group of this rank gathered inside the block (whole stages: for state dicts and loading), then
        freed. Collective over dp."""
        every: list[Unit | FlatGroup] = [*self.held, *self.groups.values()]
        for g in every:
            self.ensure(g)
        try:
            yield
        finally:
            for g in every:
                g.free()

    def sync_shards(self) -> None:
        """After values were written into the gathered parameters (loading): copy each rank's range back into
        its shard and master. Local."""
        with torch.no_grad():
            for g in self.flat_groups:
                g.master.copy_(g.full[g.lo:g.hi])
                if g.shard.data_ptr() != g.master.data_ptr():
                    g.shard.copy_(g.master)

    # -- the stage's hooks (``Stage.forward``) ------------------------------------------------------------
    def before(self, stage: int, k: int) -> None:
        u = self.groups.get((stage, k))
        if u is None:
            return
        self.ensure(u)
        if not _in_backward():
            self._prefetch((stage, k + 1))

    def after(self, stage: int, k: int, out: Any) -> None:
        if _in_backward() or (stage, k) not in self.groups:
            return
        self._free((stage, k))
        if not torch.is_grad_enabled():
            return
        if not (isinstance(out, torch.Tensor) and out.grad_fn is not None):
            self._no_backward.add((stage, k))  # no backward runs it: not prefetched for one
        else:
            self._no_backward.discard((stage, k))
            fired = [False]

            def pre_backward(_grads: Any) -> None:
                if fired[0]:
                    return
                fired[0] = True
                u = self.groups[(stage, k)]
                self.ensure(u)
                if u.trainable is not None:
                    self.sync.prepare_group(u.trainable)
                self._free((stage, k + 1))  # its backward is over: its output's gradient reached this unit
                if (stage, k - 1) not in self._no_backward:
                    self._prefetch((stage, k - 1))
            out.grad_fn.register_prehook(pre_backward)

    def enter(self, module: nn.Module | None, stage: int) -> None:
        """Zero-bubble W is about to read ``module``'s parameters (``None``: every module of ``stage``)."""
        if module is None:
            for (s, _), u in self.groups.items():
                if s == stage:
                    self.ensure(u)
            return
        key = self.of_module.get(id(module))
        if key is None or key == self._entered:
            return
        if self._entered is not None:
            self._free(self._entered)
        self.ensure(self.groups[key])
        self._entered = key
