"""``PlainStrategy``: one process, data parallelism (``DataParallel``) and tensor parallelism — every rank holds
a whole gradient per parameter (its tp shard), in ``param.grad``; the optimizer is per parameter.

Also the accumulation loop and the dp loss mean that ``ZeroStrategy`` shares (``accumulate``, ``dp_mean``).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, Callable

import torch
from torch import nn

from ...checkpoint.layout import load_model, load_optimizer, model_pieces, optimizer_pieces
from ...checkpoint.sharded import Checkpoint, Piece
from ...comm.collectives import all_reduce
from ...mesh import Mesh
from ...parallel.common.autocast import compute_autocast, precision_dtype
from ...parallel.common.materialize import ensure_sources, materialize
from ...parallel.common.memory import memory_report
from ..config import Config
from ...parallel.common.expert_tag import is_expert_param
from ..experts import Experts
from ..grad_clip import ExpertNorm, clip_, counted_grads
from ..nonfinite import Grad, param_grads, poisoned
from ..data import IGNORE
from .base import Batches, LossFn, Timings, build_optimizer, summed_loss, tensor_parallel

__all__ = ["PlainStrategy", "DataParallelSteps", "accumulate", "dp_mean", "checkpointed", "seconds"]


def checkpointed(cfg: Config, model: nn.Module) -> nn.Module:
    """``model`` with activation checkpointing per block (``parallel.activation_checkpointing``: ``full`` or
    ``selective``; ``none`` leaves it). Local."""
    mode = cfg.parallel.activation_checkpointing
    if mode != "none":
        from ...parallel.common.activation_checkpointing import checkpoint_layers
        from ..model_build import block_names

        blocks = set(block_names(model))  # blocks.i of the GPT, model.layers.i of an HF decoder
        checkpoint_layers(model, policy=lambda name, _: name in blocks, mode=mode)
    return model


def accumulate(model: Any, loss_fn: LossFn, batches: Batches, t: Timings, sync: Callable[[], None],
               device: torch.device, autocast: torch.dtype | None = None,
               marks_out: list[tuple[Any, Any, Any]] | None = None,
               phase: Callable[[str], None] | None = None) -> torch.Tensor:
    """``len(batches)`` forward/backward passes, each loss scaled by ``1/len(batches)``; gradient sync on the
    last only (earlier ones inside ``model.no_sync()`` where the wrapper has one), except where the wrapper
    says ``reduce_every_pass`` (ZeRO-2/3: gradients kept whole across passes would undo their sharding). ``autocast``: forward and
    loss under ``torch.autocast`` in that dtype (``train.precision``; backward outside it, as autograd wants).
    This rank's loss of the step (fp32). Collective as the wrapper's synchronised backward is.

    Timing: on the CPU host clocks around each phase. On a GPU, CUDA events on the current stream and ONE
    synchronize after the last pass (the step's non-finite check waits there anyway): synchronizing between
    phases would stop the host from queueing the next kernels while the GPU works: it made a 124M GPT's step
    on an H200 24 % longer at one micro-batch and 81 % longer at eight (benchmarks/RESULTS.md, "On one GPU").
    ``marks_out``: no wait at all — the marks go there, ``t`` is left alone, and the caller turns them into
    times once the step's work is done (``host_overlap.py``: the step read one step late). ``phase``: called with
    ``"forward"`` and ``"backward"`` as each begins (the memory ledger's phase meter, ``runtime/memory_ledger.py``)."""
    loss_sum = torch.zeros((), device=device)
    marks: list[tuple[Any, Any, Any]] = []  # (before forward, after forward, after backward) per pass
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        quiet = not last and hasattr(model, "no_sync") and not getattr(model, "reduce_every_pass", False)
        with model.no_sync() if quiet else nullcontext():
            m0 = _mark(device, sync)
            if phase is not None:
                phase("forward")
            with compute_autocast(device, autocast):
                loss = loss_fn(model(x), y) / len(batches)
            m1 = _mark(device, sync)
            if phase is not None:
                phase("backward")
            loss.backward()
            marks.append((m0, m1, _mark(device, sync)))
        loss_sum += loss.detach()
    if marks_out is not None:
        marks_out.extend(marks)
        return loss_sum
    if device.type == "cuda" and marks:
        marks[-1][2].synchronize()
    for m0, m1, m2 in marks:
        t["fwd"] += seconds(m0, m1)
        t["bwd"] += seconds(m1, m2)
    return loss_sum


def _mark(device: torch.device, sync: Callable[[], None]) -> Any:
    """A point in the step: a CUDA event recorded on the current stream (GPU), else the host clock after
    ``sync`` (which is a no-op on the CPU)."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    sync()
    return time.perf_counter()


def seconds(start: Any, end: Any) -> float:
    """Seconds between two ``_mark`` s: CUDA events (both complete) or host clock readings. Pure."""
    return start.elapsed_time(end) / 1e3 if isinstance(start, torch.cuda.Event) else end - start


def dp_mean(loss: torch.Tensor | float, mesh: Mesh) -> float:
    """This rank's step loss averaged over dp (in place; one all-reduce when dp > 1). Collective over dp."""
    if mesh.size("dp") > 1:
        all_reduce(loss, mesh, "dp", op="avg")
    return float(loss)


class DataParallelSteps:
    """The step shared by every layout whose ranks each run whole forward/backward passes over their dp shard of
    the batch (plain, DataParallel, tensor parallel, ZeRO): ``grad_accum`` passes, then the mean loss over dp.
    Needs ``mesh``, ``model`` and ``loss_fn``."""

    mesh: Mesh
    model: Any
    loss_fn: LossFn
    sum_loss: LossFn
    """The cross-entropy summed over counted targets (``base.summed_loss``): validation and loss-masked data."""
    autocast: torch.dtype | None = None
    """``train.precision``'s autocast dtype (None: fp32); set by the subclass from the config."""
    phase: Callable[[str], None] | None = None
    """Called as each pass's forward and backward begin (the trainer's memory ledger); None: nothing."""

    def data_shard(self) -> tuple[int, int]:
        return self.mesh.size("dp"), self.mesh.coord("dp")

    def passes(self, batches: Batches, t: Timings, sync: Callable[[], None], *, poison: bool,
               loss_fn: LossFn | None = None, marks_out: list[tuple[Any, Any, Any]] | None = None) -> torch.Tensor:
        loss = loss_fn or self.loss_fn
        return accumulate(self.model, poisoned(loss) if poison else loss, batches, t, sync, self.mesh.device,
                          self.autocast, marks_out, self.phase)

    def eval_sums(self, batches: Batches) -> tuple[float, int]:
        """Forward only over this rank's shard of the validation batches: ``(Σ cross-entropy, counted targets)``
        over every dp rank (one all-reduce of two numbers). Collective (and over tp as the forward is)."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.mesh.device)
        with torch.no_grad():
            for x, y in batches:
                with compute_autocast(self.mesh.device, self.autocast):
                    total = self.sum_loss(self.model(x), y)
                sums[0] += total.double()
                sums[1] += (y != IGNORE).sum()
        if self.mesh.size("dp") > 1:
            all_reduce(sums, self.mesh, "dp", op="sum")
        return float(sums[0]), int(sums[1])

    def mean_loss(self, loss: torch.Tensor | float) -> float:
        return dp_mean(loss, self.mesh)

    def mean_loss_tensor(self, loss: torch.Tensor) -> torch.Tensor:
        """``mean_loss`` left on the device: the all-reduce is queued, nothing is read (the trainer reads it a
        step late, ``host_overlap.py``). In place; returns ``loss`` (0-d fp32). Collective over dp."""
        if self.mesh.size("dp") > 1:
            all_reduce(loss, self.mesh, "dp", op="avg")
        return loss


class PlainStrategy(DataParallelSteps):
    """Single process, ``DataParallel`` over ``dp`` and/or ``sw.parallelize`` over ``tp`` (``Strategy``).
    ``experts`` (``parallel.ep``): ``plain``'s experts already cut over the expert mesh (``runtime/experts.py``);
    ``DataParallel`` leaves those pieces out, the one optimizer steps them with the rest. Building is collective
    (``DataParallel`` broadcasts the weights; ``parallelize``)."""

    def __init__(self, cfg: Config, mesh: Mesh, plain: nn.Module, experts: Experts | None = None) -> None:
        p = cfg.parallel
        self.mesh, self.autocast = mesh, precision_dtype(cfg.train.precision)
        self.experts = experts  # parallel.ep: plain's experts already cut (build_strategy); their grads synced apart
        ensure_sources(plain)
        module, self.loss_fn = tensor_parallel(cfg, mesh, plain)
        self.sum_loss = summed_loss(cfg, mesh)
        self.plain: nn.Module = checkpointed(cfg, module)
        self.model: nn.Module = self.plain
        if mesh.size("dp") > 1:  # dp × cp ranks with context parallelism
            from ...parallel.data.data_parallel import DataParallel

            self.model = DataParallel(self.plain, mesh, axis="dp", algorithm=p.algorithm,
                                      bucket_cap_mb=p.bucket_cap_mb)
        materialize(self.plain, mesh.device)  # what no wrapper materialised (one process, or tp's replicated part)
        self.optimizer: torch.optim.Optimizer = build_optimizer(list(self.plain.parameters()), cfg.optimizer)

    def grads(self) -> list[Grad]:
        return param_grads(self.plain)

    def scale_param_grads(self, factor: float) -> None:
        for param in self.plain.parameters():
            if param.grad is not None:
                param.grad.mul_(factor)

    def clip_grad_norm(self, max_norm: float) -> float:
        """Every ``param.grad`` (tp shards): dp replicas hold identical averaged gradients and count them all
        locally; a tp-split parameter counts on every tp rank, a replicated one on tp coordinate 0 — so one
        all-reduce over tp (none without tp)."""
        params = list(self.plain.parameters())  # each tied parameter once
        pieces = [q for q in params if is_expert_param(q)]  # parallel.ep: summed over ep apart (grad_clip.py)
        count = counted_grads([q for q in params if not is_expert_param(q)], self.mesh,
                              own_axes=set(self.mesh.axes) - {"tp"})
        extra = None
        if pieces:
            em = self.experts.emesh  # type: ignore[union-attr]
            mine = [q.grad for q in pieces if q.grad is not None] if em.coord("tp") == 0 else []
            extra = ExpertNorm(mine, em, ["ep"])
        return clip_(count, [q.grad for q in params if q.grad is not None], self.mesh, ["tp"], max_norm, extra)

    def pieces(self) -> list[Piece]:
        return model_pieces(self.plain, self.mesh) + optimizer_pieces(self.plain, self.optimizer, self.mesh)

    def shared_state(self) -> dict[str, Any]:
        return {}

    def rank_state(self) -> dict[str, Any]:
        return {}

    def load(self, ckpt: Checkpoint) -> None:
        load_model(ckpt, self.plain, self.mesh)
        load_optimizer(ckpt, self.plain, self.optimizer, self.mesh)

    def memory(self) -> dict[str, int]:
        return memory_report(self.plain, self.optimizer)
