"""``PipelineStrategy``: the pipeline side of ``shardwise train`` (``parallel.pp > 1``) — ``sw.pipeline`` with its
hybrids, one step's accumulation passes, and the checkpoint layout a pipeline rank saves and loads.

Hybrids (``config._check_pipeline_hybrids`` lists what stays rejected):

* dp: ``dp_axis="dp"`` — every rank passes each pass's ``micro_batch × dp`` sequences, each replica takes its
  slice; gradients averaged over dp inside ``pipe.step`` (bucketed, started inside the last backward);
* tp: the GPT is ``sw.parallelize``-d over ``tp`` *before* pipelining (each stage runs its tp shards) and the
  last stage's loss is the vocab-parallel cross-entropy, as without pp (``base.tensor_parallel``);
* ZeRO 1-3: ``zero_stage`` — ``pipe.build_optimizer`` gives a ``ZeroOptimizer`` over the dp gradient buckets of
  this rank's stages (optimizer state 1/dp; ZeRO-2 frees the full gradient buffers after each reduction, ZeRO-3
  shards the parameters per unit: ``parallel/pipeline/zero3.py``); checkpoint layout:
  ``checkpoint/pipeline_zero.py`` and ``pipeline_zero3.py``;
* activation checkpointing: ``checkpoint=True`` (each unit keeps only its input, recomputed in backward);
* ``train.compile``: each block compiled (``runtime/compiling.py``) before the model is cut; zero-bubble's W
  then differentiates each stage again (no weight capture inside a compiled block: ``weight_grad.py``);
* bf16 autocast (``train.precision``): ``autocast=torch.bfloat16`` — each forward action under ``torch.autocast``;
* ep (mixtures of experts): the experts are already cut over the expert mesh ``(pp, edp, ep, tp)``
  (``runtime/experts.py``) when the model is pipelined; each stage's dp buckets and ZeRO-1 flat groups leave
  them out (``parallel/pipeline/grad_sync.py``), the trainer syncs them over ``edp`` after the passes, narrowed
  to this rank's stages (``StageModules``), and every pass of ``m`` micro-batches counts ``m`` balancing losses.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...checkpoint.pipeline_layout import load_pipeline, pipeline_model_pieces, pipeline_optimizer_pieces
from ...checkpoint.pipeline_zero import load_pipeline_zero, pipeline_zero_groups, pipeline_zero_pieces
from ...checkpoint.pipeline_zero3 import zero3_model_pieces
from ...checkpoint.sharded import Checkpoint, Piece
from ...mesh import Mesh
from ...parallel.common.autocast import precision_dtype
from ...parallel.common.grad_norm import shard_pieces
from ...parallel.common.memory import storage_bytes
from ...parallel.pipeline.build import Pipeline, pipeline
from ...parallel.zero.optim import ZeroOptimizer
from ..compiling import compile_model
from ..config import Config
from ..experts import Experts
from ..grad_clip import ExpertNorm, clip_, counted_grads
from ..nonfinite import Grad, flat_grads, names_by_id, poisoned
from ..data import IGNORE
from .base import (Batches, LossFn, Timings, build_optimizer, summed_loss, tensor_parallel,
                   train_mixed_precision)

__all__ = ["PipelineStrategy"]


class PipelineStrategy:
    """``sw.pipeline`` over ``pp`` with dp, tp, ZeRO 1-3 and activation checkpointing inside (``Strategy``).
    Building is collective only as ``sw.parallelize`` is (``sw.pipeline`` itself is pure)."""

    def __init__(self, cfg: Config, mesh: Mesh, plain: nn.Module, experts: Experts | None = None) -> None:
        p = cfg.parallel
        module, loss = tensor_parallel(cfg, mesh, plain)
        compile_model(cfg, module)  # train.compile: before the cut (the stages call the same, compiled blocks)

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return loss(logits, targets) / p.grad_accum  # one pass of grad_accum, like the plain loop's scaling

        self.plain, self.mesh, self.grad_accum = module, mesh, p.grad_accum
        self.sum_loss = summed_loss(cfg, mesh)
        self.model: Pipeline = pipeline(
            module, mesh, "pp", microbatches=p.pp_microbatches, schedule=p.pp_schedule, loss_fn=loss_fn,
            split=list(p.pp_split) or None, chunks=p.pp_chunks, dp_axis="dp", zero_stage=p.zero_stage,
            checkpoint=p.activation_checkpointing, bucket_cap_mb=p.bucket_cap_mb,
            autocast=precision_dtype(cfg.train.precision), mixed_precision=train_mixed_precision(cfg))
        self.optimizer = self.model.build_optimizer(partial(build_optimizer, o=cfg.optimizer))
        # ZeRO-1 over dp only with dp > 1 (at dp = 1 the optimizer is a plain one); the ``sum_grads`` fault
        # follows the config's zero_stage, as it does without pp.
        self.zero1 = isinstance(self.optimizer, ZeroOptimizer)
        self.flat_buffers = p.zero_stage > 0
        self.experts = experts
        if experts is not None:  # grad sync, balancing-loss weight, bias and statistics: this rank's blocks only
            experts.narrow(StageModules(self.model))

    def moe_passes(self, n_batches: int) -> int:
        """Forward/backward passes of a step of ``n_batches`` accumulation batches: each ``pipe.step`` runs one
        per micro-batch, weighted ``1 / (micro-batches · grad_accum)`` (the loss scaling of ``passes``)."""
        return n_batches * self.model.microbatches

    def data_shard(self) -> tuple[int, int]:
        """Not sharded: every rank loads each pass's ``micro_batch × dp`` sequences (``pipe.step`` slices dp
        itself); the saved position (samples consumed by all ranks) is the same either way."""
        return 1, 0

    def passes(self, batches: Batches, t: Timings, sync: Callable[[], None], *, poison: bool,
               loss_fn: LossFn | None = None) -> float:
        """One ``pipe.step`` per accumulation pass; the step's mean loss (same on every rank). Times: this rank's
        F actions → fwd, B and W → bwd, the rest of ``pipe.step`` (waiting for neighbours — bubble and
        transfers —, tied-weight exchange, dp reduction) → comm. On CUDA the split is of launch times unless
        ``pipe.interpreter.synchronize_timings`` is set; the step time is exact (``step`` syncs). Collective."""
        pipe, total = self.model, 0.0
        clean = pipe.interpreter.loss_fn  # the last stage looks its loss up here, per micro-batch
        # loss_fn (loss-masked data) is scaled for the whole step (token_loss.py), which assumes the calls are
        # averaged; pipe.step averages its micro-batches and dp replicas, the passes are summed: / grad_accum
        loss = clean if loss_fn is None else _divided(loss_fn, self.grad_accum)
        pipe.interpreter.loss_fn = poisoned(loss) if poison else loss
        try:
            for (x, y), last in _with_last(batches):
                start = time.perf_counter()
                # the passes before the last accumulate unreduced: one reduction per optimizer step, and no
                # averaged shard waiting beside the full gradients through the later passes (ZeRO-2/3 free
                # the full buffers after that one reduction)
                with pipe.no_sync() if not last else contextlib.nullcontext():
                    total += pipe.step(x, y)  # mean over micro-batches and dp of lm_loss / grad_accum
                elapsed = time.perf_counter() - start
                fwd = sum(end - begin for a, begin, end in pipe.last_events if a.kind == "F")
                bwd = sum(end - begin for a, begin, end in pipe.last_events if a.kind != "F")
                t["fwd"], t["bwd"] = t["fwd"] + fwd, t["bwd"] + bwd
                t["comm"] += max(0.0, elapsed - fwd - bwd)
        finally:
            pipe.interpreter.loss_fn = clean
        return total

    def eval_sums(self, batches: Batches) -> tuple[float, int]:
        """``(Σ cross-entropy, counted targets)`` of the validation batches (every rank loads each pass's
        ``micro_batch × dp`` rows): one forward-only ``pipe.evaluate`` per pass, whose mean over the pipeline's
        micro-batches and dp replicas of ``Σ CE · m · dp`` is the pass's sum. Collective."""
        m, dp = self.model.microbatches, self.mesh.size("dp")
        summed = self.sum_loss

        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return summed(logits, targets) * (m * dp)

        total, count = 0.0, 0
        for x, y in batches:
            total += self.model.evaluate(x, y, loss_fn=loss)
            count += int((y != IGNORE).sum())
        return total, count

    def mean_loss(self, loss: torch.Tensor | float) -> float:
        """Local: ``pipe.step``'s loss is already the mean over dp."""
        return float(loss)

    def grads(self) -> list[Grad]:
        """Its stages' ``param.grad`` (with dp: views of the averaged buckets); with ZeRO-1 also each bucket's
        averaged shard (the optimizer's gradient) besides the full buffer (zero after the reduction)."""
        names = names_by_id(self.model.model)
        out = [Grad(q.grad, (names.get(id(q), "?"),)) for q in self.model.parameters() if q.grad is not None]
        sync = self.model.grad_sync
        if self.zero1 and sync is not None:
            out += flat_grads(sync.groups, sync.held_shards(), self.model.model, "pipeline bucket", shard=True)
        return out

    def scale_param_grads(self, factor: float) -> None:
        if not self.flat_buffers:
            for param in self.plain.parameters():
                if param.grad is not None:
                    param.grad.mul_(factor)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Its stages' gradients: with ZeRO-1 each bucket's averaged shard (the optimizer's gradient; ``.grad``
        is zero after the reduction), else every ``param.grad`` (dp replicas identical: counted locally). A
        weight tied to another pipeline rank counts on the lower pp coordinate; one all-reduce over pp, one
        over tp with tp, one over dp with ZeRO-1. Expert pieces (ep): each once — under ZeRO-1 on edp
        coordinate 0 (the dp sum spans edp × ep), else summed over ep first (one more all-reduce)."""
        pipe, mesh = self.model, self.mesh
        skip = {id(q) for q, peer in pipe.tied if peer < mesh.coord(pipe.axis)}
        own = {pipe.axis, "dp"}  # each pp rank its stages; dp: ZeRO-1 shards, or identical replicas
        sync = pipe.grad_sync
        experts = [q for q in pipe.expert_params() if q.grad is not None]
        em = self.experts.emesh if experts and self.experts is not None else None
        mine = [q.grad for q in experts] if em is not None and em.coord("tp") == 0 else []
        if sync is not None and sync.zero:
            scale = sync.shard_grads()
            count = shard_pieces(sync.groups, scale, mesh, sync.axis, own, skip)
            count += mine if em is not None and em.coord("edp") == 0 else []
            return clip_(count, [*scale, *(q.grad for q in experts)], mesh, [pipe.axis, "tp", sync.axis], max_norm)
        ids = {id(q) for q in pipe.expert_params()}
        params = [q for q in pipe.parameters() if id(q) not in ids]
        scale = [q.grad for q in pipe.parameters() if q.grad is not None]
        extra = ExpertNorm(mine, em, ["ep"]) if em is not None else None
        return clip_(counted_grads(params, mesh, own, skip), scale, mesh, [pipe.axis, "tp"], max_norm, extra)

    def pieces(self) -> list[Piece]:
        """Its own stages' tensors under the plain model's keys, and their optimizer state — per parameter, or
        ZeRO-1's flat shards. Local."""
        if isinstance(self.optimizer, ZeroOptimizer):
            sharded = self.model.zero3 is not None or self.model.mixed_precision is not None  # the masters' ranges
            model = zero3_model_pieces(self.model) if sharded else pipeline_model_pieces(self.model)
            return model + pipeline_zero_pieces(self.model, self.optimizer)
        return pipeline_model_pieces(self.model) + pipeline_optimizer_pieces(self.model, self.optimizer)

    def shared_state(self) -> dict[str, Any]:
        return {"pipeline_zero_groups": True} if self.zero1 else {}

    def rank_state(self) -> dict[str, Any]:
        """With ZeRO-1: this rank's group list (no rank knows the other pp coordinates' groups)."""
        return {"zero_groups": pipeline_zero_groups(self.model)} if self.zero1 else {}

    def load(self, ckpt: Checkpoint) -> None:
        if isinstance(self.optimizer, ZeroOptimizer):
            load_pipeline_zero(ckpt, self.model, self.optimizer)
        else:
            load_pipeline(ckpt, self.model, self.optimizer)

    def memory(self) -> dict[str, int]:
        sync = self.model.grad_sync
        # ZeRO-3: the parameters are empty between steps; their shards (the masters) are what this rank holds,
        # the frozen groups' included
        frozen = self.model.zero3.frozen_groups if self.model.zero3 is not None else []
        groups = [*(sync.groups if sync is not None else []), *frozen]
        params = list(self.model.parameters()) + [g.master for g in groups]
        grads = [q.grad for q in params] + ([*sync.full_grads, *sync.held_shards()] if sync is not None else [])
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        counts = storage_bytes({"params": params, "grads": grads, "optimizer": state})
        device = self.mesh.device
        peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else sum(counts.values())
        return {**counts, "peak": peak}


class StageModules(nn.Module):
    """A view of the modules a pipeline rank's stages run, under the plain model's names (``blocks.3.mlp``, not
    the stage's ``parts``): what ``runtime/experts.py``'s per-block calls iterate (``named_modules``, and so
    ``parameters``), so metrics and warnings name blocks as every layout does and released blocks of other
    stages are never touched."""

    def __init__(self, pipe: Pipeline) -> None:
        super().__init__()
        self._stages = list(pipe.stages.values())  # a plain list: not registered, no second module tree

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",  # type: ignore[override]
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        memo = set() if memo is None else memo
        for stage in self._stages:
            for key, module in stage.parts.items():
                name = key.replace("/", ".")
                yield from module.named_modules(memo, f"{prefix}.{name}" if prefix else name, remove_duplicate)


def _with_last(items: Any) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last one (a one-item lookahead: batches may be a generator)."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for nxt in it:
        yield current, False
        current = nxt
    yield current, True


def _divided(loss_fn: LossFn, n: int) -> LossFn:
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets) / n
    return loss
