"""ZeRO-3 inside a pipeline: each rank holds 1/dp of its stages' parameters and gathers a unit only while it runs.

The gathering policy (the memory/communication trade-off, chosen per unit of the stage):

* **units** are the pipeline's own (``stage.Unit``: the embedding unit, each block, the final unit). Each is one
  flat group sharded over dp (``zero.flat.FlatGroup``, ``sharded_params=True``), cut from meta so no rank ever holds
  a whole stage;
* **forward** (every micro-batch): a unit is all-gathered just before it runs — the next unit's gather is started
  (prefetch) as this one starts — and freed as soon as it returns (``reshard_after_forward``);
* **backward** (every micro-batch): a pre-hook on the first autograd node of the unit's backward gathers it again,
  prefetches the unit before it and frees the unit after it (whose backward is over by then). Recomputation
  (activation checkpointing) runs inside that window, so it sees the gathered unit;
* **zero-bubble ``W``**: the closed-form weight gradients of ``Linear`` and ``LayerNorm`` read only the kept input
  and the output gradient, so they gather nothing; any other module's local backward gathers its unit first; a
  stage that fell back to differentiating itself whole (activation checkpointing) gathers all its units for W;
* **held**: parameters used by two units of this rank, or tied to another pipeline rank (the embedding and the
  head), form one group gathered when the step starts and freed after its reduction — the tied-gradient exchange
  and every micro-batch need them;
* **gradients** accumulate over the step's micro-batches in each unit's full flat buffer (allocated when the
  unit's first backward starts) and are reduce-scattered **once per step per stage**, when the stage's last
  backward is done (``grad_sync.DpGradSync``), then freed.

Per step and unit: ``2m`` all-gathers (``3m`` with a W that needs the parameters) of the unit's parameters and one
reduce-scatter of its gradients, for ``m`` micro-batches; memory: the parameter shards, at most two gathered units
plus the held group, and the gradients of the stage's units once their first backward has run. FSDP2's
``reshard_after_forward=False`` (what torchtitan uses inside pipelines) would instead keep a stage gathered from
its first forward to its last backward: ``2`` gathers per step instead of ``2m``, but a whole stage in memory.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ... import comm
from ..zero.flat import FlatGroup
from .grad_sync import DpGradSync

__all__ = ["unit_plans", "shared_parameters", "PipelineStage3"]


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _unit_params(unit: Any) -> list[nn.Parameter]:
    seen: dict[int, nn.Parameter] = {}
    for _, m in unit.modules:
        for q in m.parameters():
            seen.setdefault(id(q), q)
    return list(seen.values())


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


class PipelineStage3:
    """Gathers and frees the units of this rank's stages as the schedule runs them (see module doc)."""

    def __init__(self, sync: DpGradSync, stages: dict[int, Any], owners: dict[int, list[int]]) -> None:
        self.sync = sync
        self.groups: dict[tuple[int, int], FlatGroup] = {}
        for s in sorted(stages):
            mine = [b.group for b in sync.buckets if b.stage == s]
            self.groups.update({(s, k): g for k, g in zip(owners.get(s, []), mine)})
        self.held = [b.group for b in sync.buckets if b.stage is None]
        self.of_module = {id(sub): key for key in self.groups  # every submodule: W names leaf modules
                          for _, m in stages[key[0]].units[key[1]].modules for sub in m.modules()}
        self.pending: dict[int, comm.Handle] = {}
        self._entered: tuple[int, int] | None = None
        for s, stage in stages.items():
            stage.unit_hook = self

    # -- gather / free ----------------------------------------------------------------------------------
    def ensure(self, g: FlatGroup) -> None:
        """Make ``g`` gathered (waiting for its prefetch, or gathering now). Collective over dp."""
        handle = self.pending.pop(id(g), None)
        if handle is None:
            if g.gathered:
                return
            handle = g.start_gather()
        g.finish_gather(handle)

    def _prefetch(self, key: tuple[int, int]) -> None:
        g = self.groups.get(key)
        if g is not None and not g.gathered and id(g) not in self.pending:
            self.pending[id(g)] = g.start_gather()

    def _free(self, key: tuple[int, int]) -> None:
        g = self.groups.get(key)
        if g is not None and g.gathered and id(g) not in self.pending:
            g.free()

    def action_done(self, stage: int) -> None:
        """After any action of ``stage``: no unit of it stays gathered (a stray prefetch is finished first)."""
        for (s, k), g in self.groups.items():
            if s == stage:
                if id(g) in self.pending:
                    g.finish_gather(self.pending.pop(id(g)))
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
        every = [*self.held, *self.groups.values()]
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
            for g in [*self.held, *self.groups.values()]:
                g.master.copy_(g.full[g.lo:g.hi])
                if g.shard.data_ptr() != g.master.data_ptr():
                    g.shard.copy_(g.master)

    # -- the stage's hooks (``Stage.forward``) ------------------------------------------------------------
    def before(self, stage: int, k: int) -> None:
        g = self.groups.get((stage, k))
        if g is None:
            return
        self.ensure(g)
        if not _in_backward():
            self._prefetch((stage, k + 1))

    def after(self, stage: int, k: int, out: Any) -> None:
        if _in_backward() or (stage, k) not in self.groups:
            return
        self._free((stage, k))
        if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.grad_fn is not None:
            fired = [False]

            def pre_backward(_grads: Any) -> None:
                if fired[0]:
                    return
                fired[0] = True
                g = self.groups[(stage, k)]
                self.ensure(g)
                self.sync.prepare_group(g)
                self._free((stage, k + 1))  # its backward is over: its output's gradient reached this unit
                self._prefetch((stage, k - 1))
            out.grad_fn.register_prehook(pre_backward)

    def enter(self, module: nn.Module | None, stage: int) -> None:
        """Zero-bubble W is about to read ``module``'s parameters (``None``: every module of ``stage``)."""
        if module is None:
            for (s, _), g in self.groups.items():
                if s == stage:
                    self.ensure(g)
            return
        key = self.of_module.get(id(module))
        if key is None or key == self._entered:
            return
        if self._entered is not None:
            self._free(self._entered)
        self.ensure(self.groups[key])
        self._entered = key
