"""A mixture-of-experts feed-forward block: a router picks ``top_k`` of ``n_experts`` SwiGLU experts per token,
the experts run as grouped matmuls over 3-D weights, optional shared experts see every token.

Parameter names and shapes are transformers 5's (so ``sw.ExpertParallel`` treats both alike)::

    gate.weight (E, h)                         router logits = x @ W.T
    experts.gate_up_proj (E, 2f, h)            per expert: [gate; up] rows
    experts.down_proj (E, h, f)
    shared_expert.{gate,up,down}_proj          a SwiGLU of width n_shared · f (optional)
    shared_expert_gate.weight (1, h)           sigmoid gate on the shared output (Qwen2-MoE; optional)

Routing: scores = softmax (or sigmoid) of the fp32 logits; the top-k experts by ``score + expert_bias`` (the
bias only selects: auxiliary-loss-free balancing, ``moe_balance.update_bias``); weights = the chosen scores,
divided by their sum when ``renorm``. The output of a token is ``Σ_k w_k · expert_k(x)`` summed in slot order.
Balancing loss, capacity, statistics: ``moe_balance.py``; expert parallelism: ``parallel/expert``.
Shapes: ``b`` batch, ``t`` sequence, ``h`` hidden, ``E`` experts, ``k`` top_k, ``f`` expert width, ``N = b·t``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..parallel.common.init_rules import Constant, InitRule, Normal
from ..parallel.expert.dispatch import ExpertShard, route
from .moe_balance import BalanceState, attach_aux, capacity_mask, sequence_aux

__all__ = ["MoESettings", "MoE", "Router", "GroupedExperts", "grouped_mm_available", "check_moe_config", "moe_layer",
           "moe_init_rule"]


@dataclass(frozen=True)
class MoESettings:
    """One MoE block's shape and routing rules (plain data; from ``GPTConfig`` or a Hugging Face config)."""

    n_experts: int
    top_k: int
    hidden: int
    ffn: int
    """Width of one expert (``moe_ffn``)."""
    shared_ffn: int = 0
    """Total width of the shared expert(s) (``n_shared_experts · moe_ffn``, or Qwen2-MoE's own); 0: none."""
    shared_gate: bool = False
    router: Literal["softmax", "sigmoid"] = "softmax"
    renorm: bool = True
    aux_coef: float = 0.0
    bias_rate: float = 0.0
    capacity_factor: float = 0.0

    def __post_init__(self) -> None:
        check_moe(self.n_experts, self.top_k, self.capacity_factor, self.router, self.bias_rate)


def check_moe(n_experts: int, top_k: int, capacity_factor: float, router: str, bias_rate: float) -> None:
    """One-line ``ValueError`` s for the routing fields (the config checks the same before any work). Pure."""
    if n_experts < 1:
        raise ValueError(f"model.n_experts must be >= 1 for an MoE block, got {n_experts}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"model.top_k ({top_k}) must be between 1 and model.n_experts ({n_experts}); "
                         f"choose e.g. --model.top_k {min(2, n_experts)}")
    if capacity_factor < 0:
        raise ValueError(f"model.capacity_factor must be >= 0 (0 = dropless), got {capacity_factor}; "
                         f"use 0 or e.g. 1.25")
    if router not in ("softmax", "sigmoid"):
        raise ValueError(f"model.router must be softmax or sigmoid, got {router!r}")
    if bias_rate < 0:
        raise ValueError(f"model.moe_bias_rate must be >= 0 (0 = off), got {bias_rate}; e.g. 0.001")


def check_moe_config(c: Any) -> None:
    """The MoE fields of a ``GPTConfig`` (``n_experts`` > 0), one-line errors naming the flag. Pure."""
    for name in ("n_experts", "top_k", "moe_ffn", "n_shared_experts", "moe_every", "moe_first_dense"):
        value = getattr(c, name)
        low = 1 if name in ("n_experts", "top_k", "moe_every") else 0
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"model.{name} must be an int >= {low}, got {value!r}")
    check_moe(c.n_experts, c.top_k, c.capacity_factor, c.router, c.moe_bias_rate)
    if c.moe_aux_loss_coef < 0:
        raise ValueError(f"model.moe_aux_loss_coef must be >= 0 (0 = no balancing loss), got {c.moe_aux_loss_coef}")
    if not any(moe_layer(i, c.n_experts, c.moe_first_dense, c.moe_every) for i in range(c.n_layer)):
        raise ValueError(f"model.moe_first_dense = {c.moe_first_dense} leaves no MoE layer among model.n_layer = "
                         f"{c.n_layer}; lower it below {c.n_layer} or set model.n_experts 0 for a dense model")


def moe_layer(i: int, n_experts: int, first_dense: int, every: int) -> bool:
    """Whether layer ``i`` is an MoE layer: experts on, past the first dense ones, every ``every``-th. Pure."""
    return n_experts > 0 and i >= first_dense and (i - first_dense) % every == 0


def moe_init_rule(module: nn.Module, attr: str, std: float, residual_std: float) -> InitRule | None:
    """How an MoE block's own parameters start: the router and ``gate_up_proj`` N(0, ``std``), ``down_proj``
    (it writes into the residual stream) N(0, ``residual_std``); None for any other module. Like every rule,
    a function of the element only, so an expert-parallel rank draws exactly its experts' one-device values."""
    if isinstance(module, Router):
        return Normal(0.0, std) if attr == "weight" else Constant(0.0)  # the selection bias starts at zero
    if isinstance(module, GroupedExperts):
        return Normal(0.0, residual_std if attr == "down_proj" else std)
    return None


_GROUPED = hasattr(F, "grouped_mm")


def grouped_mm_available(x: Tensor, w: Tensor) -> bool:
    """Whether ``F.grouped_mm`` can run ``x`` (M, K) against ``w`` (G, N, K) transposed: torch ≥ 2.10's op,
    fp32/bf16, both inner widths a multiple of 16 bytes (its stride rule). Else the per-expert loop. Pure."""
    if not _GROUPED or x.dtype not in (torch.float32, torch.bfloat16) or w.dtype != x.dtype:
        return False
    size = x.element_size()
    return (w.size(1) * size) % 16 == 0 and (w.size(2) * size) % 16 == 0


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient (``grouped_mm``'s backward rejects the expanded
    zero-stride gradients that ``sum()`` produces)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> Tensor:
        return g.contiguous()


def expert_matmul(x: Tensor, w: Tensor, counts: list[int], impl: str) -> Tensor:
    """``x`` (M, K) rows grouped by expert (``counts[e]`` rows each) times ``w[e]`` (N, K) transposed → (M, N).
    ``impl``: ``grouped`` (one ``F.grouped_mm``; the loop where it cannot run) or ``loop`` (one matmul per
    expert, zero-row ones included so every expert's gradient exists)."""
    if x.dtype != w.dtype and torch.is_autocast_enabled(x.device.type):
        w = w.to(x.dtype)  # autocast does not cover grouped_mm: the weights in the activations' dtype, as Linear
    if impl == "grouped" and grouped_mm_available(x, w) and x.size(0) > 0:
        offs = torch.tensor(counts, dtype=torch.int32, device=x.device).cumsum(0, dtype=torch.int32)
        return _ContiguousGrad.apply(F.grouped_mm(x, w.transpose(-1, -2), offs=offs))
    pieces = torch.split(x, counts, dim=0)
    # unbind, not w[e]: an indexed slice's backward writes a whole (E, N, K) zero gradient per expert (E² work)
    return torch.cat([piece @ we.t() for we, piece in zip(w.unbind(0), pieces)], dim=0)


class Router(nn.Module):
    """``gate.weight`` (E, h) and, with ``bias_rate`` > 0, the selection-only ``expert_bias`` (E,) buffer."""

    def __init__(self, s: MoESettings) -> None:
        super().__init__()
        self.s = s
        self.weight = nn.Parameter(torch.empty(s.n_experts, s.hidden))
        if s.bias_rate > 0:
            self.register_buffer("expert_bias", torch.zeros(s.n_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``x`` (N, h) → ``(scores (N, E) fp32, experts (N, k) int64, weights (N, k) fp32)``."""
        logits = F.linear(x, self.weight).float()
        scores = logits.softmax(-1) if self.s.router == "softmax" else logits.sigmoid()
        pick = scores.detach()
        if self.s.bias_rate > 0:
            pick = pick + self.expert_bias
        experts = pick.topk(self.s.top_k, dim=-1).indices  # the same scores give the same pick on every rank
        weights = scores.gather(1, experts)
        if self.s.renorm:  # at top_k 1 the weight is 1 (as transformers does; the Switch form: renorm off)
            weights = weights / weights.sum(-1, keepdim=True)
        return scores, experts, weights


class GroupedExperts(nn.Module):
    """``E`` SwiGLU experts as two 3-D weights (this rank's ``E / ep`` under expert parallelism)."""

    impl = "grouped"
    """``grouped`` (``F.grouped_mm``) or ``loop`` (one matmul per expert; the benchmark's baseline)."""

    def __init__(self, n_experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn, hidden))
        self.down_proj = nn.Parameter(torch.empty(n_experts, hidden, ffn))

    def forward(self, x: Tensor, counts: list[int]) -> Tensor:
        """``x`` (M, h) grouped by local expert, ``counts`` rows each → (M, h)."""
        gate, up = expert_matmul(x, self.gate_up_proj, counts, self.impl).chunk(2, dim=-1)  # (M, f) each
        return expert_matmul(F.silu(gate) * up, self.down_proj, counts, self.impl)


class SharedExpert(nn.Module):
    """A dense SwiGLU of width ``ffn`` that every token passes through."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """The block (see the module docstring): ``forward(x (b, t, h)) → (b, t, h)``.

    ``shard``: None (every expert here) or the ``ExpertShard`` that ``sw.ExpertParallel`` / the trainer set
    (``experts`` then holds this rank's block). ``sequence``: None, or the context-parallel split of each
    sequence (``moe_balance.SequenceSplit``) so that the balancing loss and the capacity are per whole sequence.
    ``balance``: this step's statistics (loads, dropped assignments, balancing loss)."""

    shard: ExpertShard | None = None
    sequence: Any = None
    routed: Any = None
    """None, or another expert path ``routed(x (N, h), experts (N, k), weights (N, k)) → (N, h)`` (the weighted
    sum) in place of ``route``: ``shardwise bench moe`` plugs a peer's dispatch in here."""

    def __init__(self, s: MoESettings) -> None:
        super().__init__()
        self.settings = s
        self.gate = Router(s)
        self.experts = GroupedExperts(s.n_experts, s.hidden, s.ffn)
        if s.shared_ffn:
            self.shared_expert = SharedExpert(s.hidden, s.shared_ffn)
            if s.shared_gate:
                self.shared_expert_gate = nn.Linear(s.hidden, 1, bias=False)
        self.balance = BalanceState(s.n_experts)

    def forward(self, x: Tensor) -> Tensor:
        s = self.settings
        b, t, h = x.shape
        flat = x.reshape(b * t, h)
        scores, experts, weights = self.gate(flat)  # (N, E), (N, k), (N, k)
        kept = experts
        if s.capacity_factor > 0:
            keep = capacity_mask(experts.view(b, t, s.top_k), s.n_experts, s.capacity_factor, self.sequence)
            kept = torch.where(keep.view(b * t, s.top_k), experts, torch.full_like(experts, -1))
        if self.routed is not None:
            y = self.routed(flat, kept, weights).to(x.dtype)
        else:
            outs = route(flat, kept, s.n_experts, self.experts, self.shard)  # (N, k, h)
            y = (outs * weights.unsqueeze(-1).to(outs.dtype)).sum(1)  # slot order: the same sum on every layout
        if s.shared_ffn:
            shared = self.shared_expert(flat)
            if s.shared_gate:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            y = y + shared
        if self.training and torch.is_grad_enabled():
            # training passes only: validation and generation neither count loads nor pay the loss's reductions
            aux = sequence_aux(scores.view(b, t, -1), experts.view(b, t, -1), s.n_experts, self.sequence)
            self.balance.record(experts, kept, aux)
            if s.aux_coef > 0:
                y = attach_aux(y, aux * s.aux_coef, self.balance)
        return y.view(b, t, h)
