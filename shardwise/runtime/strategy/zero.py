"""``ZeroStrategy``: ``sw.zero`` over ``dp`` (stages 1-3; tensor parallelism and activation checkpointing inside,
built like the plain path). With tp > 1 ZeRO shards each tp rank's *local* (already tp-sharded) parameters over
the dp axis only: its reduce-scatters and all-gathers run on the dp group of the rank's tp coordinate, the tp
collectives inside forward/backward stay as they are. With ``parallel.ep`` the expert pieces stay out of the flat
groups (materialised whole with the rest, even at stage 3) and have an optimizer of their own, stepped with ZeRO's
(``ZeroWithExperts``, ``zero_experts.py``: its state sharded over edp when edp > 1); their gradients are averaged by
``runtime/experts.py``. Gradients live in ZeRO's flat buffers; the optimizer steps
this rank's shards; checkpoints hold the parameters (tp shards with tp) and the flat optimizer-state shards
(``checkpoint/zero_layout.py``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ...checkpoint.sharded import Checkpoint, Piece
from ...checkpoint.zero_layout import load_zero, zero_index_state, zero_model_pieces, zero_optimizer_pieces
from ...mesh import Mesh
from ...parallel.common.autocast import precision_dtype
from ...parallel.common.grad_norm import shard_pieces
from ...parallel.common.memory import memory_report, storage_bytes
from ...parallel.zero.wrap import ZeroModel, zero
from ...parallel.zero.optim import ZeroOptimizer
from ..config import Config
from ..grad_clip import clip_
from ..model_build import block_names
from ..experts import Experts
from ..nonfinite import Grad, flat_grads, names_by_id
from .base import build_optimizer, summed_loss, tensor_parallel, train_mixed_precision
from .zero_experts import ZeroWithExperts, expert_optimizer
from .plain import DataParallelSteps, checkpointed

__all__ = ["ZeroStrategy", "ZeroWithExperts", "zero_algorithm"]


def zero_algorithm(algorithm: str, mesh: Mesh) -> str | None:
    """ZeRO's collectives under ``parallel.algorithm``: a named one as given; ``auto`` the calibration's choice
    per message where one is attached for dp's group size (as data parallelism's all-reduce), else ``None``:
    ``sw.zero``'s own default (our ring on CPU ranks, NCCL's on GPUs). Pure."""
    if algorithm != "auto":
        return algorithm
    return "auto" if mesh.size("dp") > 1 and mesh.calibration_for(mesh.size("dp")) is not None else None


class ZeroStrategy(DataParallelSteps):
    """``sw.zero(stage=parallel.zero_stage)`` over ``dp`` (``Strategy``). Building is collective over dp."""

    def __init__(self, cfg: Config, mesh: Mesh, plain: nn.Module, experts: Experts | None = None) -> None:
        p = cfg.parallel
        self.mesh, self.autocast = mesh, precision_dtype(cfg.train.precision)
        self.experts = experts
        module, self.loss_fn = tensor_parallel(cfg, mesh, plain)
        self.sum_loss = summed_loss(cfg, mesh)
        self.plain = checkpointed(cfg, module)
        # ZeRO-3 gathers one transformer layer at a time (its default finds only a ``blocks`` list)
        units = [[name] for name in block_names(self.plain)] or None
        model, optimizer = zero(self.plain, mesh, stage=p.zero_stage, axis="dp", bucket_cap_mb=p.bucket_cap_mb,
                                optimizer=partial(build_optimizer, o=cfg.optimizer), units=units,
                                algorithm=zero_algorithm(p.algorithm, mesh),
                                offload=None if p.offload == "none" else p.offload,
                                mixed_precision=train_mixed_precision(cfg))
        self.model: ZeroModel = model
        self.zero_optimizer: ZeroOptimizer = optimizer
        self.expert_params = experts.params() if experts is not None else []  # in no flat group (trainable())
        self.expert_optimizer = expert_optimizer(self.expert_params, self.plain,
                                                 experts.emesh if experts is not None else None, cfg.optimizer)
        self.optimizer: Any = (optimizer if self.expert_optimizer is None
                               else ZeroWithExperts(optimizer, self.expert_optimizer))

    def grads(self) -> list[Grad]:
        """Stage 1: each group's full buffer (after backward this rank's slice holds the averaged shard and the
        rest the reduction's partial sums: a non-finite element on any replica makes the averaged shards
        non-finite, and the flag's agreement carries it everywhere); stages 2-3: this rank's averaged
        shard of each group, the only gradient it keeps."""
        m = self.model
        names = names_by_id(self.plain)
        pieces = [Grad(q.grad, (names.get(id(q), "expert"),)) for q in self.expert_params if q.grad is not None]
        if m.stage == 1:
            return flat_grads(m.groups, m.full_grads, self.plain, "ZeRO group", shard=False) + pieces
        return flat_grads(m.groups, m.shard_grads, self.plain, "ZeRO group", shard=True) + pieces

    def scale_param_grads(self, factor: float) -> None:
        """No-op: the ``sum_grads`` fault targets per-parameter gradients, which ZeRO does not keep."""

    def clip_grad_norm(self, max_norm: float) -> float:
        """This rank's averaged shard of each flat group — what the optimizer reads (stage 1: the own slice of
        the full buffer) — counted per parameter piece (a tp-replicated one on tp coordinate 0 only); one
        all-reduce over dp, and one over tp with tp."""
        shards = self.model.shard_grads
        count = shard_pieces(self.model.groups, shards, self.mesh, "dp", {"dp"})
        pieces = [q.grad for q in self.expert_params if q.grad is not None]
        if pieces:  # parallel.ep: each expert piece once — the dp sum spans edp × ep, so edp coordinate 0 only
            em = self.experts.emesh  # type: ignore[union-attr]
            count = count + (pieces if em.coord("edp") == 0 and em.coord("tp") == 0 else [])
        return clip_(count, [*shards, *pieces], self.mesh, ["dp", "tp"], max_norm)

    def pieces(self) -> list[Piece]:
        out = zero_model_pieces(self.model, self.mesh) + zero_optimizer_pieces(self.model, self.zero_optimizer,
                                                                                self.mesh)
        if self.expert_optimizer is not None:  # the expert pieces' state (zero_experts.py)
            out += self.expert_optimizer.pieces()
        return out

    def shared_state(self) -> dict[str, Any]:
        shared = zero_index_state(self.model)[0]
        if self.expert_optimizer is not None and self.expert_optimizer.rank_groups():
            shared["zero_groups_per_rank"] = True  # the experts' flat groups are listed in the rank files
        return shared

    def rank_state(self) -> dict[str, Any]:
        """With tp: this rank's flat groups (each tp coordinate's hold its own tp pieces); with experts sharded
        over edp, their flat group too."""
        own = zero_index_state(self.model)[1]
        extra = self.expert_optimizer.rank_groups() if self.expert_optimizer is not None else []
        return {**own, "zero_groups": [*own.get("zero_groups", []), *extra]} if extra else own

    def load(self, ckpt: Checkpoint) -> None:
        load_zero(ckpt, self.model, self.zero_optimizer)
        if self.expert_optimizer is not None:
            self.expert_optimizer.load(ckpt)

    def memory(self) -> dict[str, int]:
        report = memory_report(self.model, self.zero_optimizer)
        if self.model.offload:  # parallel.offload: the bytes kept in host memory (on CPU ranks, the same memory)
            report["offloaded"] = storage_bytes({"host": self.model.offloaded_tensors(self.zero_optimizer)})["host"]
        if self.expert_optimizer is not None:  # the experts' own optimizer state
            report["optimizer"] += sum(v.numel() * v.element_size() for st in self.expert_optimizer.state.values()
                                       for v in st.values() if isinstance(v, torch.Tensor))
        return report

