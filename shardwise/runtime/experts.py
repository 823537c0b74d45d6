"""Expert parallelism in ``shardwise train`` (``parallel.ep``; mixtures of experts, ``model.n_experts > 0``).

The ``ep`` ranks are folded into the data-parallel ranks: the runtime mesh's ``dp`` axis (``dp × cp`` wide with
context parallelism, ``runtime/context_split.py``) is cut into ``edp × ep`` with ``ep`` innermost, so the expert
mesh is ``(edp, ep, tp)`` — ``(pp, edp, ep, tp)`` with a pipeline — over the same ranks in the same order as the
runtime mesh ``(dp, tp)`` / ``(pp, dp, tp)`` (``dp = edp · ep + ep coordinate``). Each MoE block keeps experts
``[i·E/ep, (i+1)·E/ep)`` on ep coordinate ``i`` (``parallel.expert.shard_experts``, on the plain meta model before
any wrapper); the data-parallel wrappers leave those tagged parameters alone, and ``Experts.sync_grads`` averages
their gradients as one device would (sum over ``edp``, divide by dp × cp: ``parallel.expert.ExpertGradSync``).

Who calls what: ``build_strategy`` (``strategy/__init__.py``) calls ``setup_experts`` on the plain meta model
before any strategy is built and passes the result to the strategy's constructor as the keyword ``experts``
(``Experts | None``; None for a dense model), which keeps it as ``self.experts``. A pipeline strategy calls
``experts.narrow(stage_module)`` when its rank holds only some blocks, and may define ``moe_passes(n) -> int``
(the number of forward/backward passes whose balancing losses make up a step of ``n`` accumulation batches:
``n × pipeline micro-batches``); without it the trainer uses ``n``. The trainer then, per step, for every layout:

1. ``grad_scale(passes)`` before the passes: each pass's balancing loss weighs ``1 / passes`` of the step's loss
   (``moe_balance.set_grad_scale``), as the LM loss does;
2. ``sync_grads()`` after the passes, before clipping and the non-finite check (collective over ``edp``; with
   ep = 1 the experts are ordinary data-parallel parameters and it does nothing);
3. ``after_step(model)`` after ``optimizer.step()``: the auxiliary-loss-free bias update (``update_bias``) and
   the step's routing statistics (``step_stats``), both with the loads summed over the runtime mesh's ``dp``
   axis (the ranks whose tokens differ; tp ranks see the same tokens) and the balancing loss averaged over it.
   Returns the statistics per MoE block (``aux``, ``min``, ``max``, ``cv``, ``dropped``, ``starved``);
   ``warnings()`` then lists the experts that received no token for ``STARVED_STEPS`` consecutive steps (once
   per streak). The trainer logs them in each step's metrics record under ``moe``; its logged ``loss`` is the
   LM loss alone (the balancing loss only enters the gradients, and ``moe.*.aux`` reports it).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..mesh import Mesh
from ..models.moe_balance import dp_reducer, moe_blocks, set_grad_scale, step_stats, update_bias
from ..parallel.expert.grads import ExpertGradSync
from ..parallel.expert.shard import expert_params, shard_experts
from .config_schema import Config, ParallelConfig

__all__ = ["STARVED_STEPS", "expert_mesh_axes", "expert_mesh", "Experts", "setup_experts"]

STARVED_STEPS = 20
"""Consecutive steps without a single token after which an expert is reported as starved (a warning line)."""


def expert_mesh_axes(p: ParallelConfig) -> dict[str, int]:
    """``(edp, ep, tp)``, with a pipeline ``(pp, edp, ep, tp)``: the runtime mesh (``strategy.mesh_axes``) with its
    ``dp × cp``-wide ``dp`` axis cut into ``edp × ep``, ``ep`` inner — the same ranks in the same order. Pure."""
    dp = p.dp * p.cp
    if dp % p.ep:
        raise ValueError(f"parallel.ep = {p.ep} must divide parallel.dp × parallel.cp = {p.dp} × {p.cp} = {dp}; "
                         f"pick an ep that divides it")
    axes = dict(edp=dp // p.ep, ep=p.ep, tp=p.tp)
    return dict(pp=p.pp, **axes) if p.pp > 1 else axes


def expert_mesh(cfg: Config, mesh: Mesh) -> Mesh:
    """The expert mesh (``expert_mesh_axes``) on ``mesh``'s device, with its deadline and calibration.
    Collective (creates the process groups of each axis)."""
    return Mesh(**expert_mesh_axes(cfg.parallel), timeout_s=cfg.train.timeout_s,
                calibration=list(mesh.calibrations.values()) or None)


class Experts:
    """The runtime's expert-parallel and balancing steps of one rank (module docstring). ``model``: the module
    whose MoE blocks this rank runs (the plain model; a pipeline stage narrows it with ``narrow``); ``mesh``: the
    runtime mesh (its ``dp`` axis sums the loads); ``emesh``: the expert mesh (None when ep = 1)."""

    def __init__(self, model: nn.Module, mesh: Mesh, emesh: Mesh | None, ep: int) -> None:
        self.model, self.mesh, self.emesh, self.ep = model, mesh, emesh, ep
        self.reduce: Callable[[Tensor], Tensor] = dp_reducer(mesh, "dp")
        self._sync: ExpertGradSync | None = None
        self._quiet: dict[tuple[str, int], int] = {}  # (block, expert) -> consecutive steps without a token
        self._warnings: list[str] = []

    def narrow(self, model: nn.Module) -> None:
        """Sync, scale and count only ``model``'s blocks and expert parameters (a pipeline rank's stages)."""
        self.model, self._sync = model, None

    def params(self) -> list[nn.Parameter]:
        """This rank's expert parameters (its pieces; empty when ep = 1: the experts are ordinary parameters)."""
        return expert_params(self.model) if self.emesh is not None else []

    def grad_scale(self, passes: int) -> None:
        """Before a step's passes: the weight of one pass's balancing loss, ``1 / passes``. Local."""
        set_grad_scale(self.model, 1.0 / max(1, passes))

    def sync_grads(self) -> None:
        """After the passes: expert gradients become the one-device average (collective over the expert mesh's
        ``edp`` axis: one coalesced all-reduce per dtype; none when edp = 1). No-op when ep = 1."""
        if self.emesh is None:
            return
        if self._sync is None:
            # every rank of the data-parallel axis averages: dp × cp ranks (the runtime mesh's dp axis)
            self._sync = ExpertGradSync(self.params(), self.emesh, "edp", self.mesh.size("dp"))
        self._sync.sync()

    def after_step(self, model: nn.Module | None = None) -> dict[str, dict[str, float]]:
        """After ``optimizer.step()`` (or a skipped step): the selection-bias update and this step's statistics
        per MoE block (the counts are reset). Collective over the runtime mesh's ``dp`` axis (two all-reduces of
        a few numbers per block when dp > 1)."""
        target = self.model if model is None else model
        update_bias(target, self.reduce)
        blocks = list(moe_blocks(target))
        # this rank's mean balancing loss per block rides along with the loads: the step's is their dp mean
        local_aux = torch.tensor([[float(b.balance._aux_sum) / b.balance.passes
                                   if b.balance._aux_sum is not None and b.balance.passes else 0.0]
                                  for _, b in blocks], dtype=torch.float64).reshape(len(blocks), 1)
        loads: list[Tensor] = []

        def keep(table: Tensor) -> Tensor:  # step_stats' (n_blocks, E + 1) table, summed over dp
            summed = self.reduce(torch.cat([table, local_aux], dim=1))
            loads.append(summed)
            return summed[:, :-1]
        stats = step_stats(target, keep)
        if loads:
            self._count_quiet([name for name, _ in blocks], loads[0][:, :-2])
            for (name, _), aux in zip(blocks, loads[0][:, -1].tolist()):
                stats[name]["aux"] = aux / self.mesh.size("dp")
        return self._over_stages(stats)

    def _over_stages(self, stats: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """With a pipeline each rank holds its stages' blocks: every rank gets all stages' statistics and
        starvation warnings (one object all-gather over pp per step), so rank 0's record covers the model."""
        if "pp" not in self.mesh.axes or self.mesh.size("pp") == 1:
            return stats
        every: list[tuple[dict[str, dict[str, float]], list[str]] | None] = [None] * self.mesh.size("pp")
        dist.all_gather_object(every, (stats, self._warnings), group=self.mesh.group("pp"))
        merged: dict[str, dict[str, float]] = {}
        warnings: list[str] = []
        for part in every:
            if part is not None:
                merged.update(part[0])
                warnings += [w for w in part[1] if w not in warnings]
        self._warnings = warnings
        return dict(sorted(merged.items(), key=lambda kv: _block_order(kv[0])))

    def skipped(self, model: nn.Module | None = None) -> None:
        """A step dropped by the non-finite guard: its counts are cleared without a bias update. Local."""
        for _, block in moe_blocks(self.model if model is None else model):
            block.balance.reset()

    def _count_quiet(self, names: list[str], loads: Tensor) -> None:
        for name, row in zip(names, loads.tolist()):
            for e, load in enumerate(row):
                key = (name, e)
                self._quiet[key] = self._quiet.get(key, 0) + 1 if load == 0 else 0
                if self._quiet[key] == STARVED_STEPS:
                    self._warnings.append(f"warning: {name} expert {e} has received no token for {STARVED_STEPS} "
                                          f"consecutive steps (router collapse? try model.moe_bias_rate > 0 or a "
                                          f"larger model.moe_aux_loss_coef)")

    def warnings(self) -> list[str]:
        """The starvation warnings found since the last call (each expert once per streak). Local."""
        out, self._warnings = self._warnings, []
        return out


def setup_experts(cfg: Config, mesh: Mesh, plain: nn.Module) -> Experts | None:
    """For a model with MoE blocks: with ``parallel.ep > 1`` build the expert mesh and cut ``plain``'s experts over
    its ``ep`` axis (call on the plain — usually meta-device — model before any wrapper); returns the per-step
    ``Experts``. None for a dense model. Collective when ep > 1 (the expert mesh's groups); no data moves."""
    if not any(True for _ in moe_blocks(plain)):
        return None
    ep = cfg.parallel.ep
    emesh = None
    if ep > 1:
        emesh = expert_mesh(cfg, mesh)
        shard_experts(plain, emesh, "ep")
    return Experts(plain, mesh, emesh, ep)


def _block_order(name: str) -> tuple:
    """``blocks.10.mlp`` after ``blocks.9.mlp``: numeric parts compared as numbers."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))
