"""``sw.ExpertParallel``: the plan style that splits a mixture of experts' experts over a mesh axis whose ranks
hold the same tokens (a tensor-parallel axis), for ``sw.parallelize(model, mesh, plan, axis=...)``.

    plan = {"model.layers.*.mlp.experts": sw.ExpertParallel()}
    sw.parallelize(model, mesh, plan, axis="tp")   # a transformers MixtralForCausalLM, Qwen2/3-MoE, or ours

Rank ``i`` of ``P`` keeps experts ``[i·E/P, (i+1)·E/P)`` of the 3-D ``gate_up_proj`` (E, 2f, h) and
``down_proj`` (E, h, f) — an ``S(0)`` piece annotated with its global shape (``sbp.params``), so
``sw.full_state_dict`` and the checkpoints gather it as they do tensor-parallel weights — computes only its
experts' contributions, and the output is summed over the axis: forward all-reduce, backward identity, and the
gradients of the inputs (the tokens; transformers' routing weights too) summed in backward — the Megatron pair
of ``comm/autograd.py``. Per MoE layer and pass: one all-reduce forward, one (ours) or two (transformers':
tokens and routing weights) backward; everything else is as on one device.

Two kinds of experts module are recognised by their shape, not their class:

* transformers 5's (``MixtralExperts``, ``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ...): 3-D ``gate_up_proj`` /
  ``down_proj`` in the concatenated [gate; up] layout, ``act_fn``, ``forward(hidden (N, h), top_k_index (N, k),
  top_k_weights (N, k)) → (N, h)``. It is replaced by ``ExpertParallelExperts``, which keeps the parameter
  names (state-dict keys unchanged) and computes the same sum per token;
* ``shardwise.models.moe``'s ``GroupedExperts`` inside an ``MoE`` (a parent with a ``shard`` attribute and
  ``settings.n_experts``): its weights are cut in place and the parent's ``shard`` becomes a replicated-token
  ``ExpertShard`` (``dispatch.py``), whose route sums the (N, k, h) outputs over the axis.

``E`` must divide by ``P``. Local at apply time (nothing communicates); a meta-device module keeps deferred
pieces that read only their experts when materialised.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ...comm.autograd import allreduce_identity, identity_allreduce
from ...mesh import Mesh
from ...sbp.params import annotate
from ...sbp.placement import Replicate, Split
from ..common.materialize import deferred_piece, ensure_sources
from .dispatch import ExpertShard, local_ids, route

__all__ = ["ExpertParallel", "ExpertParallelExperts", "check_expert_parallel", "apply_expert_parallel",
           "expert_kind", "split_plan", "match_experts"]

WEIGHTS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertParallel:
    """Plan style for an experts module (see the module docstring): each rank of the axis keeps ``E / P``
    experts and the outputs are summed over the axis. Its ranks must see the same tokens."""


def expert_kind(module: nn.Module, parent: nn.Module | None) -> str | None:
    """``"ours"`` (a ``GroupedExperts`` in an ``MoE``), ``"hf"`` (transformers' 3-D experts) or None. Pure."""
    weights = [getattr(module, w, None) for w in WEIGHTS]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights) or weights[0].size(0) != weights[1].size(0):
        return None
    if parent is not None and hasattr(parent, "shard") and hasattr(getattr(parent, "settings", None), "n_experts"):
        return "ours"
    if callable(getattr(module, "act_fn", None)):
        return "hf"
    return None


def check_expert_parallel(name: str, module: nn.Module, parent: nn.Module | None, size: int) -> None:
    """``ValueError`` when ``ExpertParallel`` cannot split ``module`` over ``size`` ranks. Pure."""
    kind = expert_kind(module, parent)
    if isinstance(module, ExpertParallelExperts):
        raise ValueError(f"{name}: its experts are already split (ExpertParallel); parallelize the plain model once")
    if kind is None:
        raise ValueError(f"{name}: ExpertParallel applies to an experts module with 3-D gate_up_proj (E, 2f, h) and "
                         f"down_proj (E, h, f) (transformers' MixtralExperts/Qwen*MoeExperts, or the experts of "
                         f"shardwise.models.moe.MoE), got {type(module).__name__}; match the '...mlp.experts' modules")
    n = module.gate_up_proj.size(0)
    if n % size:
        raise ValueError(f"{name}: {n} experts do not divide over {size} ranks; choose an axis size among "
                         f"{[d for d in range(1, n + 1) if n % d == 0]}")
    if kind == "ours" and getattr(parent, "shard", None) is not None:
        raise ValueError(f"{name}: its MoE block's experts are already split (expert parallelism); parallelize the "
                         f"plain model once")
    if kind == "hf":
        layout = {a: getattr(module, a, d) for a, d in (("has_bias", False), ("is_transposed", False),
                                                         ("is_concatenated", True), ("has_gate", True))}
        if layout != {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True}:
            raise ValueError(f"{name}: ExpertParallel supports gated, concatenated, untransposed experts without "
                             f"biases; {type(module).__name__} has {layout}")


def _piece(full: Tensor, mesh: Mesh, axis: str, first: int, local: int) -> nn.Parameter:
    """Experts ``[first, first + local)`` of ``full`` as a parameter annotated ``S(0)`` over ``axis``."""
    if full.is_meta:
        p = deferred_piece(full, [(first, local)], None)
    else:
        with torch.no_grad():
            p = nn.Parameter(full.detach()[first:first + local].clone(), requires_grad=full.requires_grad)
    sbp = [Split(0) if a == axis else Replicate() for a in mesh.axes]
    return annotate(p, mesh, sbp, shape=tuple(full.shape))


def apply_expert_parallel(model: nn.Module, name: str, mesh: Mesh, axis: str, algorithm: str = "native") -> None:
    """Split the experts module ``name`` of ``model`` over ``axis`` (checked by ``check_expert_parallel``
    first). Local."""
    module = model.get_submodule(name)
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    n = module.gate_up_proj.size(0)
    shard = ExpertShard(mesh, axis, n, algorithm, replicated=True)
    if any(getattr(module, w).is_meta for w in WEIGHTS):
        ensure_sources(model)
    pieces = {w: _piece(getattr(module, w), mesh, axis, shard.first, shard.local) for w in WEIGHTS}
    if expert_kind(module, parent) == "ours":
        for w, p in pieces.items():
            setattr(module, w, p)
        parent.shard = shard
        return
    new = ExpertParallelExperts(pieces["gate_up_proj"], pieces["down_proj"], module.act_fn, shard)
    new.train(module.training)
    setattr(parent, child, new)


class ExpertParallelExperts(nn.Module):
    """transformers' experts module split over a replicated-token axis: this rank's ``gate_up_proj`` (E/P, 2f, h)
    and ``down_proj`` (E/P, h, f) under the original names; ``forward(hidden (N, h), top_k_index (N, k),
    top_k_weights (N, k)) → (N, h)``, collective over the axis."""

    def __init__(self, gate_up_proj: nn.Parameter, down_proj: nn.Parameter, act_fn: Callable[[Tensor], Tensor],
                 shard: ExpertShard) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act_fn, self.shard = gate_up_proj, down_proj, act_fn, shard
        self.num_experts = shard.n_experts

    def _experts(self, x: Tensor, counts: list[int]) -> Tensor:
        """Rows of ``x`` (M, h) grouped by local expert (``counts``) through their SwiGLU → (M, h); every
        expert runs (zero rows too), so every expert's gradient exists."""
        pieces = torch.split(x, counts, dim=0)
        outs = []
        for e, piece in enumerate(pieces):
            gate, up = F.linear(piece, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(F.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs, dim=0)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        s = self.shard
        x = identity_allreduce(hidden_states, s.mesh, s.axis, algorithm=s.algorithm)
        w = identity_allreduce(top_k_weights, s.mesh, s.axis, algorithm=s.algorithm)
        outs = route(x, local_ids(top_k_index, s.first, s.local), s.local, self._experts)  # (N, k, h)
        y = (outs * w.unsqueeze(-1)).sum(1).to(hidden_states.dtype)
        return allreduce_identity(y, s.mesh, s.axis, algorithm=s.algorithm)

    def extra_repr(self) -> str:
        s = self.shard
        return f"experts [{s.first}, {s.first + s.local}) of {s.n_experts}, axis={s.axis}"


def split_plan(plan: Any) -> tuple[dict[str, ExpertParallel], dict[str, Any]]:
    """(``ExpertParallel`` entries, the rest) of a plan mapping. Pure."""
    experts = {k: v for k, v in plan.items() if isinstance(v, ExpertParallel)}
    return experts, {k: v for k, v in plan.items() if not isinstance(v, ExpertParallel)}


def match_experts(model: nn.Module, patterns: Any, size: int) -> list[str]:
    """The experts modules the ``ExpertParallel`` patterns match (``fnmatch`` over ``named_modules()``), each
    checked (``check_expert_parallel``). ``ValueError`` for a pattern that matches nothing. Pure."""
    modules = dict(model.named_modules())
    names: list[str] = []
    for pattern in patterns:
        hits = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise ValueError(f"plan pattern {pattern!r} (ExpertParallel) matches no module; experts modules look "
                             f"like: {', '.join(n for n in modules if n.endswith('experts')) or 'none found'}")
        names += [n for n in hits if n not in names]
    for n in names:
        check_expert_parallel(n, modules[n], modules.get(n.rpartition(".")[0]), size)
    return names
