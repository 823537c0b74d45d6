"""The experts' optimizer under ``ZeroStrategy`` (``parallel.ep`` with ``parallel.zero_stage``): expert pieces are
in no ZeRO flat group (each ep rank holds other experts: ``data/replicas.trainable`` leaves them out), so they get
an optimizer of their own, stepped with ZeRO's as one object (``ZeroWithExperts``).

With ``edp > 1`` (more data-parallel ranks than ep: ranks ``edp`` apart hold the same experts) the experts'
optimizer state is sharded over ``edp`` as ZeRO-1 shards a flat group (``ExpertShards``): the pieces are laid end to
end in one flat buffer of ``L`` elements (``parallel/zero/flat.FlatGroup`` on the expert mesh's ``edp`` axis, the
parameters views into it), each edp rank steps its ``shard_sizes(L, edp)`` slice from the averaged gradients
(``runtime/experts.py`` all-reduces them over edp first) and one all-gather over edp refreshes the rest. Its
state is checkpointed as ZeRO's is: ``zero/experts.ep<c>/<state>`` — ``S(0)`` over edp of the flat state of ep
coordinate ``c`` — and a group entry per rank (each parameter's extent in the whole (E, ...) tensor), so
``checkpoint/flat_state.param_state`` rebuilds full per-parameter state for any other layout. With edp = 1 it is
a per-parameter optimizer (``optim/<name>/<state>`` pieces, ``S(0)`` over ep).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...checkpoint.flat_state import param_state
from ...checkpoint.layout import load_optimizer, optimizer_pieces
from ...checkpoint.sharded import Checkpoint, Piece
from ...checkpoint.zero_layout import fill_flat_state, flat_state_pieces, group_entry
from ...mesh import Mesh
from ...parallel.zero.flat import FlatGroup
from ...parallel.zero.optim import ZeroOptimizer
from ..config import OptimizerConfig
from .base import build_optimizer

__all__ = ["ExpertOptimizer", "ExpertShards", "ZeroWithExperts", "expert_optimizer"]


class ExpertOptimizer:
    """A per-parameter optimizer over the expert pieces (edp = 1): ``step``, ``zero_grad``, ``param_groups``,
    its checkpoint pieces and loading (``optim/<name>/<state>``, the pieces' own layout). Local."""

    def __init__(self, params: list[nn.Parameter], plain: nn.Module, mesh: Mesh, o: OptimizerConfig) -> None:
        self.plain, self.mesh = plain, mesh
        self.optimizer = build_optimizer(params, o)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def pieces(self) -> list[Piece]:
        return optimizer_pieces(self.plain, self.optimizer, self.mesh)

    def rank_groups(self) -> list[dict[str, Any]]:
        return []

    def load(self, ckpt: Checkpoint) -> None:
        load_optimizer(ckpt, self.plain, self.optimizer, self.mesh)


class ExpertShards(ExpertOptimizer):
    """The expert pieces' optimizer state sharded over the expert mesh's ``edp`` axis (module docstring).
    ``step`` is collective over edp (one all-gather of the flat parameters)."""

    def __init__(self, params: list[nn.Parameter], plain: nn.Module, emesh: Mesh, o: OptimizerConfig) -> None:
        names = {id(q): n for n, q in plain.named_parameters()}
        self.plain, self.mesh = plain, emesh
        # stages 1-2 style: the parameters become views of the flat buffer, the master its slice [lo, hi)
        self.group = FlatGroup([names[id(q)] for q in params], list(params), emesh, "edp",
                               compute_dtype=params[0].dtype, sharded_params=False)
        self.optimizer = build_optimizer([self.group.master], o)
        self.key = f"experts.ep{emesh.coord('ep')}"  # one flat group per ep coordinate (other experts)

    @torch.no_grad()
    def step(self) -> None:
        g = self.group
        g.master.grad = g.flat_grads(g.master.dtype)[g.lo:g.hi]  # the averaged gradients' slice of this rank
        self.optimizer.step()
        g.master.grad = None
        if g.shard.data_ptr() != g.master.data_ptr():
            g.shard.copy_(g.master)
        g.finish_gather(g.start_gather())  # every edp rank's updated slice into the parameters

    def zero_grad(self) -> None:
        for q in self.group.params:
            q.grad = None
        self.group.master.grad = None

    def pieces(self) -> list[Piece]:
        """``zero/experts.ep<c>/<state>``: ``S(0)`` over edp, described without ep (the key names it). Local."""
        state = self.optimizer.state.get(self.group.master, {})
        return flat_state_pieces(self.key, self.group, state, self.mesh, "edp", ["ep"])

    def rank_groups(self) -> list[dict[str, Any]]:
        """This rank's flat group entry (``zero_layout.group_entry``: names, extents in the (E, ...) tensors)."""
        return [group_entry(self.key, self.group, list(self.group.names), self.mesh)]

    @torch.no_grad()
    def load(self, ckpt: Checkpoint) -> None:
        """State from any layout's checkpoint (this rank's slice of its ep piece's flat state); the parameters
        (loaded into their views by the model's loader) copied into the master slice too. Local."""
        g = self.group
        g.load_full([q.detach().clone() for q in g.params])
        saved, fetch = param_state(ckpt)
        fill_flat_state(self.optimizer, [g], [list(g.names)], saved, fetch)


def expert_optimizer(params: list[nn.Parameter], plain: nn.Module, emesh: Mesh | None,
                     o: OptimizerConfig) -> ExpertOptimizer | None:
    """The experts' optimizer: sharded over edp when the expert mesh has edp > 1, else per parameter; None
    without expert pieces. Local (the flat buffer is built from the materialised pieces)."""
    if not params or emesh is None:
        return None
    if emesh.size("edp") > 1:
        return ExpertShards(params, plain, emesh, o)
    return ExpertOptimizer(params, plain, emesh, o)


class ZeroWithExperts:
    """ZeRO's optimizer (the dense flat shards) and the experts' (``ExpertOptimizer``) stepped as one: what the
    trainer calls — ``param_groups`` (the learning rate is set on every group of both), ``step``, ``zero_grad``
    — and the two state dicts."""

    def __init__(self, zero_opt: ZeroOptimizer, experts: ExpertOptimizer) -> None:
        self.zero, self.experts = zero_opt, experts

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.zero.param_groups, *self.experts.param_groups]

    def step(self) -> bool:
        """ZeRO's step (collective over dp), then the experts' (collective over edp when sharded); both skip
        on an fp16 overflow."""
        stepped = self.zero.step()
        if stepped:
            self.experts.step()
        self.experts.zero_grad()
        return stepped

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.zero.zero_grad(set_to_none)
        self.experts.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        return {"zero": self.zero.state_dict(), "experts": self.experts.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zero.load_state_dict(state["zero"])
        self.experts.optimizer.load_state_dict(state["experts"])
