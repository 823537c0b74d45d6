"""The ``Strategy`` protocol: one parallel layout of ``shardwise train``, chosen once per run.

A strategy owns what differs between layouts — how the model is built and wrapped, how one step's
accumulation passes run and synchronise, which gradient tensors a rank holds (the non-finite guard), and
how its tensors are laid out in a checkpoint — so the trainer (``trainer.py``) and the checkpoint code hold
no per-layout branches. Implementations: ``PlainStrategy`` (single process, data and tensor parallelism:
every rank holds whole per-parameter gradients), ``ZeroStrategy`` (``sw.zero``) and ``PipelineStrategy``
(``sw.pipeline`` with its dp/tp/ZeRO-1 hybrids); ``build_strategy`` (``__init__.py``) picks one from the config.

Also here: what the implementations share — the optimizer factory of the config and the tensor-parallel setup
(``sw.parallelize`` plus the vocab-parallel loss), used by the plain path and inside pipeline stages alike.
"""

from __future__ import annotations

import fnmatch
from functools import partial
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...checkpoint.sharded import Checkpoint, Piece
from ...mesh import Mesh
from ...models.gpt import lm_loss
from ...parallel.common.mixed_precision import MixedPrecision
from ..config import Config, OptimizerConfig, replicated_modules
from ..nonfinite import Grad
from ..optimizer_impl import implementation_kwargs

__all__ = ["Strategy", "LossFn", "Batches", "Timings", "build_optimizer", "tensor_parallel", "summed_loss",
           "train_mixed_precision"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Batches = list[tuple[torch.Tensor, torch.Tensor]]
Timings = dict[str, float]
"""Phase times of one step in seconds (``fwd``, ``bwd``, ``comm``, ...); ``passes`` adds to them."""


class Strategy(Protocol):
    """One parallel layout of the trainer (see module docstring). Attributes: ``model`` — what the step calls
    (the wrapper: ``DataParallel``, ``ZeroModel``, ``Pipeline``, or the plain module); ``plain`` — the plain
    module inside (its names and keys are the checkpoint's); ``optimizer`` — steps what ``model`` holds."""

    model: Any
    plain: nn.Module
    optimizer: Any

    def data_shard(self) -> tuple[int, int]:
        """``(dp size, dp rank)`` the data sampler shards over (a pipeline shards inside ``pipe.step``). Local."""
        ...

    sum_loss: LossFn
    """The layout's cross-entropy summed over counted targets (``summed_loss``)."""

    def passes(self, batches: Batches, t: Timings, sync: Callable[[], None], *, poison: bool,
               loss_fn: LossFn | None = None) -> torch.Tensor | float:
        """The step's ``grad_accum`` forward/backward passes with gradient synchronisation; returns this rank's
        loss of the step (already the dp mean for a pipeline). ``poison``: multiply the loss by NaN (debug
        fault). ``loss_fn``: a loss already scaled for the whole step (``token_loss.TokenNormalized``) instead
        of the layout's mean. Adds phase times to ``t``; ``sync`` waits for queued device work. Collective."""
        ...

    def eval_sums(self, batches: Batches) -> tuple[float, int]:
        """Forward only (no gradients touched) over this rank's share of validation batches: ``(Σ cross-entropy,
        counted targets)`` over the whole mesh's data, the same on every rank. Collective."""
        ...

    def mean_loss(self, loss: torch.Tensor | float) -> float:
        """The step's loss averaged over dp, as a float. Collective over dp (where not already averaged)."""
        ...

    def grads(self) -> list[Grad]:
        """Every gradient tensor this rank holds after the passes (``nonfinite.py``). Local, no host sync."""
        ...

    def scale_param_grads(self, factor: float) -> None:
        """Multiply per-parameter gradients by ``factor`` (debug fault ``sum_grads``); no-op for layouts whose
        gradients live in ZeRO's flat buffers. Local."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip this step's gradients (after the passes, before ``optimizer.step()``) so that their L2 norm over
        the whole model is at most ``max_norm``, as ``torch.nn.utils.clip_grad_norm_`` on one device over every
        parameter; returns that norm before clipping (the same on every rank). Scales every gradient tensor the
        optimizer reads (ZeRO: the flat shards). Collective: one all-reduce of one fp32 number per mesh axis
        whose ranks hold different gradient pieces (``grad_clip.py``)."""
        ...

    def pieces(self) -> list[Piece]:
        """This rank's checkpoint pieces (model, then optimizer state) with their SBP. Collective for ZeRO
        (gathers the parameters); local otherwise — call it on every rank."""
        ...

    def shared_state(self) -> dict[str, Any]:
        """JSON entries this layout adds to the checkpoint index state. Local."""
        ...

    def rank_state(self) -> dict[str, Any]:
        """JSON entries this layout adds to this rank's file of the checkpoint. Local."""
        ...

    def load(self, ckpt: Checkpoint) -> None:
        """Load model and optimizer state from a checkpoint of any layout. Local (file reads)."""
        ...

    def memory(self) -> dict[str, int]:
        """This rank's model-state bytes: ``params``, ``grads``, ``optimizer``, ``peak`` (``sw.memory_report``).
        Local."""
        ...


def build_optimizer(params: Sequence[nn.Parameter], o: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW or SGD over ``params``. Weight decay applies to every parameter alike, so that ZeRO's flat
    shards (which mix matrices, biases and norms) optimise the same objective as every other layout.
    ``optimizer.implementation``: fused, foreach or the loop (``optimizer_impl.implementation_kwargs``)."""
    params = [p for p in params if p.requires_grad]  # frozen parameters (a LoRA base) get no optimizer state
    how = implementation_kwargs(params, o)
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.beta1, weight_decay=o.weight_decay, **how)
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                             **how)


def tensor_parallel(cfg: Config, mesh: Mesh, plain: nn.Module) -> tuple[nn.Module, LossFn]:
    """``(model, loss)``: with ``parallel.tp > 1`` the model (GPT or HF decoder: its own ``tensor_parallel_plan``,
    with ``parallel.sequence_parallel`` its sequence-parallel one) ``sw.parallelize``-d over ``tp`` (in place) and the
    vocab-parallel cross-entropy (the logits stay vocab-sharded); else ``plain`` and ``lm_loss``. The one
    tensor-parallel setup of the trainer: the plain path and a pipeline's stages both use it. Collective only
    as ``sw.parallelize`` is."""
    if cfg.parallel.tp <= 1:
        return plain, lm_loss
    from ...parallel.tensor.apply_plan import parallelize, vocab_parallel_cross_entropy

    whole = replicated_modules(cfg)  # parallel.replicate: kept whole (the tied embedding and head)
    sp = cfg.parallel.sequence_parallel  # the model's plan then covers its norms (and GPT's wpe) too
    names = [n for n, _ in plain.named_modules() if n]
    # a pattern of the model's own plan that names nothing is left out: a mixture of experts whose every layer is
    # MoE has no dense MLP ("blocks.*.mlp.fc"); its routers and experts stay whole on every tp rank
    plan = {pattern: style for pattern, style in plain.tensor_parallel_plan(sequence_parallel=sp).items()
            if pattern not in whole and any(fnmatch.fnmatchcase(n, pattern) for n in names)}
    model = parallelize(plain, mesh, plan, axis="tp", seed=cfg.train.seed, sequence_parallel=sp,
                        async_tp=cfg.parallel.async_tp)  # the collectives overlapped with the matmuls
    if "lm_head" in whole:
        return model, lm_loss  # every tp rank holds the whole logits: the plain cross-entropy
    vocab_ce = partial(vocab_parallel_cross_entropy, mesh=mesh, axis="tp", vocab_size=cfg.model.vocab_size)

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # Under bf16 autocast (train.precision) the logits are bf16. One process's F.cross_entropy is on
        # autocast's fp32 list: it casts them to fp32 and returns an fp32 loss; a custom autograd function is
        # not on that list, so cast here, or the loss would come back rounded to bf16 (~3 digits). No-op in fp32.
        return vocab_ce(logits.float(), targets)
    return model, loss


def summed_loss(cfg: Config, mesh: Mesh) -> LossFn:
    """The layout's cross-entropy summed over the counted targets (``targets == -100`` skipped; 0 when none
    count): the plain one, or the vocab-parallel one when ``tensor_parallel`` split the LM head. The trainer
    divides it by a token count itself (``token_loss.py``: validation, loss-masked data), so that every layout
    weighs each counted token alike, as one device does. Collective over tp as the vocab-parallel loss is."""
    if cfg.parallel.tp > 1 and "lm_head" not in replicated_modules(cfg):
        from ...parallel.tensor.apply_plan import vocab_parallel_cross_entropy

        return partial(_vocab_sum, ce=partial(vocab_parallel_cross_entropy, mesh=mesh, axis="tp",
                                              vocab_size=cfg.model.vocab_size, reduction="sum"))
    return _plain_sum


def _plain_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # logits (b, t, v), targets (b, t); under autocast F.cross_entropy computes in fp32
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")


def _vocab_sum(logits: torch.Tensor, targets: torch.Tensor, *, ce: Callable[..., torch.Tensor]) -> torch.Tensor:
    return ce(logits.float(), targets)  # fp32, as in tensor_parallel's loss (autocast does not cover it)


def train_mixed_precision(cfg: Config) -> MixedPrecision | None:
    """``train.precision = bf16-mixed``: bf16 compute weights and gradients, fp32 masters and optimizer state in
    ZeRO's shards, gradients reduced in bf16 in place (an fp32 reduction would need an fp32 copy of every bucket
    in flight, and an fp32 shard); else None."""
    if cfg.train.precision != "bf16-mixed":
        return None
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
