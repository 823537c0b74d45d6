"""Load balance of an MoE block, defined so that every layout gives one device's numbers.

- **Balancing loss, per sequence** (Switch/GShard form, averaged over sequences): for a sequence of ``T``
  tokens, ``f_e = E/(k·T) · #{tokens that chose e}`` and ``P_e = 1/T · Σ_t p_t,e``; its loss is ``Σ_e f_e·P_e``
  (1 when perfectly balanced) and the block's is the mean over the micro-batch's sequences. A sequence never
  spans data-parallel ranks or micro-batches, so the value does not depend on how they cut the batch; under
  context parallelism the two statistics are summed over the cp ranks first (``SequenceSplit``). Its gradient
  enters backward at the block's output (``attach_aux``), scaled by ``BalanceState.grad_scale`` — the share of
  the step's loss one pass carries (``1 / passes``; the trainer sets it) — so no schedule has to carry it to
  the last pipeline stage.
- **Capacity** (``capacity_factor`` c > 0): expert e takes at most ``ceil(c·k·T/E)`` assignments of each
  sequence, the earliest positions first (slot order within a token); the rest are dropped (the token keeps
  its other experts and the residual). Per sequence again, so independent of the layout.
- **Auxiliary-loss-free balancing** (``moe_bias_rate`` r > 0): after each optimizer step every block's
  selection bias moves by ``r · sign(mean load − load_e)`` with the loads counted over the whole step's batch
  (``update_bias``, one all-reduce over the data-parallel ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn

from ..comm.autograd import allreduce_identity, identity_allreduce
from ..comm.collectives import all_gather, all_reduce
from ..mesh import Mesh

__all__ = ["BalanceState", "SequenceSplit", "attach_aux", "capacity_mask", "sequence_aux", "moe_blocks",
           "update_bias", "step_stats", "set_grad_scale"]


@dataclass(frozen=True)
class SequenceSplit:
    """Context parallelism's cut of each sequence: ``axis`` of ``mesh`` holds ``2·cp`` chunks, rank c the chunks
    ``c`` and ``2·cp−1−c`` (``parallel.context.SeqLayout``)."""

    mesh: Mesh
    axis: str = "cp"

    @property
    def size(self) -> int:
        return self.mesh.size(self.axis)


class BalanceState:
    """One block's running statistics over a step (reset by ``step_stats``): ``load`` (E,) assignments chosen
    per expert, ``dropped`` assignments, ``aux`` summed over passes and ``passes``. A recomputation in backward
    (activation checkpointing) is not counted twice."""

    def __init__(self, n_experts: int) -> None:
        self.n_experts = n_experts
        self.grad_scale = 1.0
        self.reset()

    def reset(self) -> None:
        self.load = torch.zeros(self.n_experts, dtype=torch.float64, device="cpu")  # not meta, whatever the model
        self.dropped, self.aux, self.passes = 0, 0.0, 0
        self._aux_sum: Tensor | None = None

    def record(self, chosen: Tensor, kept: Tensor, aux: Tensor) -> None:
        """``chosen`` (N, k) experts picked, ``kept`` (N, k) the same with ``-1`` where capacity dropped one."""
        if torch._C._current_graph_task_id() != -1:  # a recomputation inside backward: counted already
            return
        with torch.no_grad():
            load = torch.bincount(chosen.reshape(-1), minlength=self.n_experts).to("cpu", torch.float64)
            self.load += load
            self.dropped += int((kept < 0).sum())
            self._aux_sum = aux.detach() if self._aux_sum is None else self._aux_sum + aux.detach()
        self.passes += 1


class _AttachAux(torch.autograd.Function):
    """Identity on ``y``; backward also hands ``aux`` the gradient ``grad_scale`` (as if ``aux`` were added to
    the loss with that weight)."""

    @staticmethod
    def forward(ctx: Any, y: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return y.view_as(y)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, Tensor, None]:
        return g, torch.full((), ctx.scale, dtype=torch.float32, device=g.device), None


def attach_aux(y: Tensor, aux: Tensor, state: BalanceState) -> Tensor:
    """``y`` unchanged; backward adds ``∂(grad_scale · aux)``."""
    return _AttachAux.apply(y, aux, state.grad_scale)


def _over_sequence(x: Tensor, split: SequenceSplit | None) -> Tensor:
    """Per-sequence sums summed over the cp ranks (forward all-reduce, backward all-reduce: every cp rank
    holds the same loss, and the data-parallel average over cp then gives each chunk its one-device share)."""
    if split is None or split.size == 1:
        return x
    return allreduce_identity(identity_allreduce(x, split.mesh, split.axis), split.mesh, split.axis)


def sequence_aux(scores: Tensor, chosen: Tensor, n_experts: int, split: SequenceSplit | None = None) -> Tensor:
    """The balancing loss (module docstring): ``scores`` (b, t, E) fp32, ``chosen`` (b, t, k) → a 0-d fp32 tensor,
    the mean over the b sequences."""
    b, t, k = chosen.shape
    hits = torch.zeros(b, n_experts, device=scores.device, dtype=torch.float32)
    hits.scatter_add_(1, chosen.reshape(b, t * k), torch.ones(b, t * k, device=scores.device))  # (b, E)
    probs = scores.sum(1)  # (b, E)
    cp = 1 if split is None else split.size
    hits = _over_sequence(hits, split)
    probs = _over_sequence(probs, split)
    T = t * cp
    f = hits * (n_experts / (k * T))
    return (f * (probs / T)).sum(-1).mean()


def capacity_mask(chosen: Tensor, n_experts: int, factor: float, split: SequenceSplit | None = None) -> Tensor:
    """``chosen`` (b, t, k) → (b, t, k) bool: which assignments fit their expert's per-sequence capacity
    ``ceil(factor·k·T/E)``, the earliest positions first (module docstring)."""
    b, t, k = chosen.shape
    cp = 1 if split is None else split.size
    cap = math.ceil(factor * k * t * cp / n_experts)
    onehot = torch.nn.functional.one_hot(chosen, n_experts).to(torch.int64)  # (b, t, k, E)
    if cp == 1:
        before = onehot.view(b, t * k, n_experts).cumsum(1).view(b, t, k, n_experts) - onehot
    else:
        before = _chunked_before(onehot, split)
    rank = (before * onehot).sum(-1)  # (b, t, k): earlier assignments to the same expert
    return rank < cap


def _chunked_before(onehot: Tensor, split: SequenceSplit) -> Tensor:
    """``before`` counts for a rank holding chunks c and 2·cp−1−c of each sequence: the counts of every chunk
    come from all cp ranks (one all-gather of (b, 2, E)), and a chunk starts after all earlier chunks."""
    b, t, k, e = onehot.shape
    cp, c = split.size, split.mesh.coord(split.axis)
    halves = onehot.view(b, 2, (t // 2) * k, e)
    per_chunk = halves.sum(2)  # (b, 2, E)
    gathered = all_gather(per_chunk.contiguous(), split.mesh, split.axis, dim=1)  # (b, 2·cp, E) rank order
    order = [q for r in range(cp) for q in (r, 2 * cp - 1 - r)]  # chunk id of each gathered slot
    by_chunk = torch.empty_like(gathered)
    by_chunk[:, order] = gathered
    start = by_chunk.cumsum(1) - by_chunk  # (b, 2·cp, E): assignments in earlier chunks
    offsets = torch.stack([start[:, c], start[:, 2 * cp - 1 - c]], dim=1)  # (b, 2, E)
    inner = halves.cumsum(2) - halves + offsets.unsqueeze(2)
    return inner.view(b, t, k, e)


def moe_blocks(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, block)`` of every MoE block in ``model`` (ours, by the ``balance`` state they carry)."""
    for name, module in model.named_modules():
        if isinstance(getattr(module, "balance", None), BalanceState):
            yield name, module


def set_grad_scale(model: nn.Module, scale: float) -> None:
    """The weight of one pass's balancing loss in the step's loss (``1 / passes``; 1 for a plain backward)."""
    for _, block in moe_blocks(model):
        block.balance.grad_scale = scale


def update_bias(model: nn.Module, reduce: Callable[[Tensor], Tensor] | None = None) -> None:
    """Auxiliary-loss-free balancing after an optimizer step: each block's ``expert_bias`` += ``rate ·
    sign(mean − load)``. ``reduce``: sums the (n_blocks, E) loads over the ranks whose tokens differ (the
    data-parallel ones); None on one device. Collective when ``reduce`` is."""
    blocks = [(n, m) for n, m in moe_blocks(model) if m.settings.bias_rate > 0]
    if not blocks:
        return
    loads = torch.stack([m.balance.load for _, m in blocks])  # (n_blocks, E) fp64
    if reduce is not None:
        loads = reduce(loads)
    for (_, m), load in zip(blocks, loads):
        bias = m.gate.expert_bias
        step = torch.sign(load.mean() - load).to(bias.dtype) * m.settings.bias_rate
        bias.add_(step.to(bias.device))


def dp_reducer(mesh: Mesh, axis: str) -> Callable[[Tensor], Tensor]:
    """A ``reduce`` for ``update_bias`` / ``step_stats``: sums over ``axis`` of ``mesh`` (on its device)."""
    def reduce(t: Tensor) -> Tensor:
        if mesh.size(axis) == 1:
            return t
        moved = t.to(mesh.device)
        all_reduce(moved, mesh, axis, op="sum")
        return moved.to("cpu")
    return reduce


def step_stats(model: nn.Module, reduce: Callable[[Tensor], Tensor] | None = None,
               reset: bool = True) -> dict[str, dict[str, float]]:
    """Per block this step: ``aux`` (mean balancing loss over passes), ``min``/``max`` assignments per expert,
    ``cv`` (their coefficient of variation), ``dropped`` assignments, ``starved`` experts (no token). Loads
    summed by ``reduce`` over the data-parallel ranks. ``reset``: clear the counts (after ``update_bias``)."""
    blocks = list(moe_blocks(model))
    if not blocks:
        return {}
    rows = [torch.cat([m.balance.load, torch.tensor([float(m.balance.dropped)], dtype=torch.float64)])
            for _, m in blocks]
    table = torch.stack(rows)  # (n_blocks, E + 1)
    if reduce is not None:
        table = reduce(table)
    out: dict[str, dict[str, float]] = {}
    for (name, m), row in zip(blocks, table):
        load, st = row[:-1], m.balance
        aux = float(st._aux_sum) / st.passes if st._aux_sum is not None and st.passes else 0.0
        mean = float(load.mean())
        out[name] = {"aux": aux, "min": float(load.min()), "max": float(load.max()),
                     "cv": float(load.std(unbiased=False)) / mean if mean else 0.0,
                     "dropped": float(row[-1]), "starved": float((load == 0).sum())}
        if reset:
            st.reset()
    return out
