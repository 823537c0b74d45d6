"""``sw.pipeline``: run a model as a pipeline of stages along one mesh axis.

    pipe = sw.pipeline(model, mesh, axis="pp", microbatches=8, schedule="1f1b", loss_fn=lm_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)      # this rank's stage parameters only
    loss = pipe.step(inputs, targets)                     # collective along "pp"; same float on every rank
    opt.step(); opt.zero_grad()
    full = sw.full_state_dict(pipe)                       # collective; the whole model under its own keys

Every rank builds the same model (same seed) and passes it; each keeps the stages it runs (stage ``s`` on the
rank with pp coordinate ``s % pp``). Building the pipeline is pure: all validation happens before any
communication. Tied parameters (the GPT's ``wte.weight`` is ``lm_head.weight``) used by stages on two ranks
are held by both; after each step's backward the two ranks exchange their gradient contributions and add
them, so both copies receive the same update as the single tied parameter on one device.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn

from ... import comm
from ...mesh import Mesh
from ..common.autocast import check_autocast
from ..common.expert_tag import is_expert_param
from ..common.materialize import ensure_sources, materialize
from ..common.grad_norm import clip_counted, counted, shard_pieces
from ..common.mixed_precision import MixedPrecision
from ..zero.optim import ZeroOptimizer
from ...comm.shm_p2p import shm_link_for
from .communication import check_transport, lower_communication, receive_placement
from .executor import Interpreter, run_actions
from .evaluate import evaluate, micro_batches
from .actions import Action
from .schedules import get_schedule
from .grad_sync import DpGradSync, expert_counted
from .model_state import full_meta, full_state, key_owner, release_other_stages
from .simulate import Event
from .batching import normalize_example
from .capture import Graph
from .graph_stage import build_graph_stages
from .stage import Stage, build_stages
from .validate import check_args, check_hybrid, check_keys, checkpoint_mode
from .measured import measured_timeline, write_trace
from .optimizer import pipeline_optimizer
from .tied import sum_tied_grads, tied_parameters
from .mixed import cast_inputs, cast_the_rest, check_mixed_precision, masters_gathered, reduce_dtype_of
from .zero3 import PipelineStage3, shared_parameters, unit_plans

__all__ = ["Pipeline", "pipeline"]


class Pipeline:
    """This rank's stages of a pipelined model plus the interpreter of its schedule. Build with ``pipeline``."""

    def __init__(self, model: nn.Module, mesh: Mesh, axis: str, *, microbatches: int, schedule: str,
                 loss_fn: Callable[[Any, Tensor], Tensor] | None, split: Sequence[str] | None, chunks: int,
                 dp_axis: str | None = None, zero_stage: int = 0, checkpoint: bool | str = False,
                 bucket_cap_mb: float = 25, release: bool = True, recv_ahead: int | None = None,
                 recv_before_send: bool | None = None, autocast: torch.dtype | None = None,
                 transport: str = "auto", example_inputs: Any = None,
                 mixed_precision: MixedPrecision | None = None) -> None:
        check_args(mesh, axis, microbatches, schedule, loss_fn, chunks, graph=example_inputs is not None)
        check_transport(transport, mesh.device.type)
        check_autocast(autocast)
        check_hybrid(mesh, axis, dp_axis, zero_stage, checkpoint, bucket_cap_mb, graph=example_inputs is not None)
        check_mixed_precision(mixed_precision, zero_stage, mesh.size(dp_axis) if dp_axis else 1, autocast)
        self.mixed_precision = mixed_precision
        p = mesh.size(axis)
        self.mesh, self.axis, self.microbatches, self.dp_axis = mesh, axis, microbatches, dp_axis
        self.schedule = get_schedule(schedule, p=p, m=microbatches, chunks=chunks)
        self.recv_ahead, self.recv_before_send = receive_placement(mesh.device.type, recv_ahead, recv_before_send)
        # validates recv_ahead up front, before the model is cut
        lowered = lower_communication(self.schedule, recv_ahead=self.recv_ahead,
                                      recv_before_send=self.recv_before_send)
        ensure_sources(model)  # a meta-device model: each rank materialises its own stages only (below)
        self.all_stages: list[Any] = (build_stages(model, p * chunks, split) if example_inputs is None else
                                      build_graph_stages(model, p * chunks, split, _example_on(model, example_inputs)))
        self.graph: Graph | None = self.all_stages[0].graph if example_inputs is not None else None
        """The captured forward (graph pipelines; ``graph.describe()`` prints it), else ``None``."""
        self.loss_fn = loss_fn
        self.model = model  # keys and shapes of the whole model, for full_state_dict
        me = mesh.coord(axis)
        check_keys(model, self.all_stages)
        self.tied = tied_parameters(self.all_stages, p, me)
        # ZeRO-3 cuts each unit's shard straight from the meta model (the groups, below): no rank builds a stage whole
        zero3 = zero_stage == 3 and dp_axis is not None and mesh.size(dp_axis) > 1
        self.stages = {s.index: s if zero3 else _materialized(s, mesh.device)
                       for s in self.all_stages if s.index % p == me}
        self._meta = full_meta(model)  # full shapes and dtypes of every key, before anything is released
        modules = {name: s.index % p for s in reversed(self.all_stages) for name in s.owned_names()}
        self._key_owner = key_owner(self._meta, modules)  # a tied key: its first stage's coordinate
        self.released_bytes = release_other_stages(model, self.stages.values()) if release else 0
        """Bytes of other stages' parameters and buffers freed on this rank at construction."""
        mode = checkpoint_mode(model, checkpoint, schedule, self.schedule.split_backward)
        for stage in self.stages.values():
            stage.checkpoint = mode
        self.zero_stage = zero_stage
        self.transport = transport
        """As requested: ``native``, ``shm`` or ``auto`` (``used_transport`` says what runs, from the first step)."""
        self._transport_chosen = False
        self.lowered = lowered
        """The schedule with its send/receive actions, every rank's list (what each interpreter runs)."""
        self.actions = lowered.ranks[me]
        self.interpreter = Interpreter(schedule=self.schedule, stages=self.stages, mesh=mesh, axis=axis,
                                       loss_fn=loss_fn, autocast=autocast,
                                       n_values={s.index: getattr(s, "n_send", 1) for s in self.all_stages})
        self._build_dp(dp_axis, zero_stage, bucket_cap_mb, zero3)
        self.last_peak_held = 0
        """After ``step``: the most micro-batch activation sets this rank held at once (schedule memory)."""
        self.last_events: list[tuple[Action, float, float]] = []
        """After ``step``: this rank's compute actions with host-clock start and end (see ``timeline``)."""
        self._evaluator: Interpreter | None = None  # evaluate's forward-only interpreter, built on first use
        self._eval_actions: tuple[Action, ...] = ()

    def _build_dp(self, dp_axis: str | None, zero_stage: int, bucket_cap_mb: float, zero3: bool) -> None:
        """Data parallelism around the stages: gradient buckets, ZeRO's groups, mixed precision's casts."""
        mesh = self.mesh
        self.grad_sync: DpGradSync | None = None
        self.zero3: PipelineStage3 | None = None
        """ZeRO-3 (``zero_stage=3`` with dp > 1): gathers and frees the units as the schedule runs (``zero3.py``)."""
        if dp_axis is not None and mesh.size(dp_axis) > 1:
            self._build_grad_sync(mesh, dp_axis, zero_stage, bucket_cap_mb)
        if zero3:  # what no group holds: buffers, expert parameters, frozen ones of another dtype
            for stage in self.stages.values():
                _materialized(stage, mesh.device)
        if self.mixed_precision is not None and self.grad_sync is not None:
            managed = {id(q) for g in self.grad_sync.groups for q in g.params}
            cast_the_rest(self.stages, managed, self.mixed_precision.param_dtype)
        self.interpreter.grad_sync = self.grad_sync
        self.interpreter.zero3 = self.zero3

    def _build_grad_sync(self, mesh: Mesh, dp_axis: str, zero_stage: int, bucket_cap_mb: float) -> None:
        """The dp gradient buckets; ZeRO-3: one sharded group per unit, and the runtime that gathers them."""
        late = {id(q) for q, _ in self.tied}
        owners: dict[int, list[int]] = {}

        def plan(s: int, kept: list[nn.Parameter]) -> list[list[int]]:
            entries, owners[s] = unit_plans(self.stages[s], kept)
            return entries

        if zero_stage == 3:
            late |= shared_parameters(self.stages)  # used by two units of this rank: held through the step
        mp = self.mixed_precision
        self.grad_sync = DpGradSync(self._stage_params(), mesh, dp_axis, zero=zero_stage > 0, stage=zero_stage,
                                    late=late, cap_bytes=int(bucket_cap_mb * 2**20),
                                    units=plan if zero_stage == 3 else None,
                                    compute_dtype=mp.param_dtype if mp else None,
                                    reduce_dtype=reduce_dtype_of(mp, mp.param_dtype) if mp else None)
        if zero_stage == 3:
            self.zero3 = PipelineStage3(self.grad_sync, self.stages, owners)

    # -- training ------------------------------------------------------------------------------------
    def step(self, *args: Any, **kwargs: Any) -> float:
        """One training step over all micro-batches: forward, backward, gradients accumulated into this
        rank's stage parameters (tied ones summed across their two ranks). Returns the mean loss over the
        micro-batches on every rank. Collective along the pipeline axis; every rank passes the same tensors.

        Chain pipelines: ``step(inputs, targets)``. Graph pipelines (built with ``example_inputs``): the model's
        own arguments, ``step(input_ids=ids, labels=ids)``, with the targets last when ``loss_fn`` is given
        (``batching.py``)."""
        inputs, targets = micro_batches(self, args, kwargs, self.loss_fn, "step")
        inputs = cast_inputs(inputs, self.compute_dtype)
        self._choose_transport()
        sync = self.grad_sync if self.grad_sync is not None and self.grad_sync.syncing else None
        self.interpreter.grad_sync = sync  # under no_sync: nothing armed, nothing reduced
        if self.grad_sync is not None:
            self.grad_sync.begin_step()
        if self.zero3 is not None:
            self.zero3.hold()
        before = {id(p): (p.grad.clone() if p.grad is not None else None) for p, _ in self.tied}
        state = run_actions(self.interpreter, self.actions, inputs, targets)  # type: ignore[arg-type]
        self.last_peak_held = state.peak_held
        self.last_events = state.events
        self._sum_tied_grads(before)
        if sync is not None:
            sync.finish()  # tied buckets start now; the others started inside the schedule
        elif self.grad_sync is not None:
            self.grad_sync.unreduced = True
        if self.zero3 is not None:
            self.zero3.release()
        return self._mean_loss(state.losses)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """``pipe.step`` s inside accumulate this replica's gradients in its buffers without reducing them over dp;
        the next ``step`` outside reduces the sum (gradient accumulation with one reduction per optimizer step, as
        DDP's ``no_sync``). The optimizer step (and clipping) inside, or before that step, raises. ZeRO-2/3 keep
        their full gradient buffers meanwhile. Local."""
        sync = self.grad_sync
        previous = sync.syncing if sync is not None else True
        if sync is not None:
            sync.syncing = False
        try:
            yield
        finally:
            if sync is not None:
                sync.syncing = previous

    def evaluate(self, *args: Any, loss_fn: Callable[[Any, Tensor], Tensor] | None = None, **kwargs: Any) -> float:
        """The mean loss of a batch, forward only (validation): the arguments, dp slicing and micro-batches of
        ``step``; ``loss_fn`` replaces the pipeline's for this call. Under ``no_grad``, stages in eval mode;
        gradients, optimizer state, ``last_events`` and the next ``step`` are untouched. Collective along the
        pipeline axis (one activation message per micro-batch per boundary) and dp (one loss all-reduce)."""
        return evaluate(self, args, kwargs, loss_fn)

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """``mixed_precision``'s parameter dtype (floating inputs are cast to it), else ``None``."""
        return self.mixed_precision.param_dtype if self.mixed_precision is not None else None

    @property
    def used_transport(self) -> str | None:
        """``shm`` or ``native``: how this pipeline's messages travel; ``None`` before the first step."""
        return self.interpreter.transport if self._transport_chosen else None

    def _choose_transport(self) -> None:
        """On the first step: the shared-memory link for ``shm`` (``ValueError`` when the axis' ranks are on
        several hosts) or ``auto`` (when they share one host and the mesh is on the CPU). Collective along the
        axis (the rendezvous: every rank of the pipeline axis calls ``step``), before any stage runs."""
        if self._transport_chosen:
            return
        if self.transport != "native" and self.mesh.device.type == "cpu" and self.mesh.size(self.axis) > 1:
            self.interpreter.p2p = shm_link_for(self.mesh, self.axis, required=self.transport == "shm",
                                                what="transport='shm'", fix="use transport='native' or 'auto'")
        self._transport_chosen = True

    def _mean_loss(self, losses: list[Tensor]) -> float:
        last_rank = self.schedule.rank_of(self.schedule.num_stages - 1)
        out = torch.stack(losses).float().mean().reshape(1) if losses else torch.zeros(1, device=self.mesh.device)
        if self.mesh.size(self.axis) > 1:
            comm.broadcast(out, self.mesh, self.axis, src=last_rank, algorithm=self.interpreter.transport)
        if self.dp_axis and self.mesh.size(self.dp_axis) > 1:
            comm.all_reduce(out, self.mesh, self.dp_axis, op="avg")
        return float(out.item())

    def _sum_tied_grads(self, before: dict[int, Tensor | None]) -> None:
        sum_tied_grads(self.mesh, self.axis, self.tied, before)

    # -- timings ---------------------------------------------------------------------------------------
    def timeline(self) -> list[Event]:
        """The last step's compute actions on every pipeline rank, measured: seconds from the earliest start.

        Host clock (``time.perf_counter``): ranks on one machine share it; across machines the offsets are
        not aligned. Collective along the pipeline axis (one all-gather); every rank gets every event.
        """
        return measured_timeline(self)

    def write_trace(self, path: str | Path) -> list[Event]:
        """Write the last step's measured timeline as a Chrome/Perfetto trace (JSON trace-event format, one
        thread per pipeline rank; open in chrome://tracing or ui.perfetto.dev). Collective along the axis;
        pipeline coordinate 0 writes the file. Returns the events (``timeline_plot.plot_timeline`` draws them)."""
        return write_trace(self, path)

    # -- parameters and state ------------------------------------------------------------------------
    def _stage_params(self) -> dict[int, list[tuple[str, nn.Parameter]]]:
        """Local stage -> its (name, parameter) pairs, each parameter under the first local stage using it."""
        seen: set[int] = set()
        out: dict[int, list[tuple[str, nn.Parameter]]] = {}
        for s, stage in sorted(self.stages.items()):
            out[s] = [(n, q) for n, q in stage.named_parameters() if id(q) not in seen]
            seen.update(id(q) for _, q in out[s])
        return out

    def build_optimizer(self, factory: Callable[..., torch.optim.Optimizer]) -> torch.optim.Optimizer | ZeroOptimizer:
        """The optimizer for this rank's stage parameters: ``factory(list(pipe.parameters()))`` — or, with
        ``zero_stage`` 1-3, a ``ZeroOptimizer`` running ``factory`` on this rank's dp shard of each gradient
        bucket (optimizer state 1/dp; ``step()`` all-gathers the updated parameters over dp at stages 1-2,
        collective). ``factory``: e.g. ``functools.partial(torch.optim.AdamW, lr=3e-4)``."""
        return pipeline_optimizer(self, factory)

    def expert_params(self) -> list[nn.Parameter]:
        """This rank's expert-parallel stage parameters (tagged by ``shard_experts``), each once, in
        ``parameters()`` order: outside the dp buckets, their gradients are the caller's to sync over the ranks
        holding the same experts (``parallel.expert.grads.ExpertGradSync``) after the step's last ``step``."""
        return [q for q in self.parameters() if is_expert_param(q)]

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip this step's gradients so the norm over the *whole* model is at most ``max_norm``; returns that
        norm before clipping, as ``torch.nn.utils.clip_grad_norm_`` on one device. Call after ``step`` and
        before the optimizer step (and, with experts, after their ``ExpertGradSync``). Collective over every mesh
        axis (one all-reduce of one number each)."""
        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
        own = {self.axis} | ({self.dp_axis} if self.dp_axis else set())
        skip = {id(q) for q, peer in self.tied if peer < self.mesh.coord(self.axis)}  # the lower coordinate counts
        sync, experts = self.grad_sync, [q for q in self.expert_params() if q.grad is not None]
        if sync is not None and sync.zero:  # ZeRO-1: every replica holds the averaged shard of each bucket
            scale = sync.shard_grads() + [q.grad for q in experts]
            count = shard_pieces(sync.groups, scale, self.mesh, sync.axis, own, skip)
        else:  # every dp replica holds the same averaged gradients: coordinate 0 counts them
            scale = [q.grad for q in self.parameters() if q.grad is not None]
            first = self.dp_axis is None or self.mesh.coord(self.dp_axis) == 0
            count = [q.grad for q in self.parameters() if q.grad is not None and first and not is_expert_param(q)
                     and counted(q, self.mesh, own, skip)]
        count += [q.grad for q in experts if expert_counted(q, self.axis)]  # after the caller's ExpertGradSync
        return clip_counted(count, scale, mesh=self.mesh, max_norm=max_norm, norm_type=norm_type)

    def parameters(self) -> Iterator[nn.Parameter]:
        """This rank's stage parameters (each once), for the user's optimizer."""
        seen: set[int] = set()
        for s in self.stages.values():
            for p in s.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

    def zero_grad(self, set_to_none: bool = True) -> None:
        for s in self.stages.values():
            s.zero_grad(set_to_none=set_to_none)

    def stage_names(self) -> dict[int, list[str]]:
        """Stage index -> the original module names it runs, for every stage (not only this rank's)."""
        return {s.index: s.owned_names() for s in self.all_stages}

    def full_state_dict(self) -> dict[str, Tensor]:
        """The whole model's tensors under the original ``state_dict`` keys, on every rank. Collective along
        the pipeline axis: each stage's owner broadcasts its tensors (one broadcast per owner rank and dtype);
        with tensor parallelism inside the stages also over tp (all-gathers of the sharded tensors)."""
        if self.mixed_precision is not None and self.grad_sync is not None:  # the fp32 masters, gathered over dp
            frozen = self.zero3.frozen_groups if self.zero3 is not None else []  # ZeRO-3's frozen shards too
            with masters_gathered([*self.grad_sync.groups, *frozen], zero3=self.zero3 is not None):
                return full_state(self.model, self._meta, self._key_owner, self.mesh, self.axis)
        if self.zero3 is not None:  # ZeRO-3: every unit gathered over dp meanwhile (collective over dp)
            with self.zero3.gathered():
                return full_state(self.model, self._meta, self._key_owner, self.mesh, self.axis)
        return full_state(self.model, self._meta, self._key_owner, self.mesh, self.axis)


def _materialized(stage: nn.Module, device: torch.device) -> nn.Module:
    """``stage`` on ``device``: meta tensors read from their sources there, the rest moved."""
    materialize(stage, device)
    return stage.to(device)


def _example_on(model: nn.Module, example: Any) -> tuple[tuple, dict]:
    """``example_inputs`` as ``(args, kwargs)``, its tensors on the model's device (the capture runs there)."""
    args, kwargs = normalize_example(example)
    device = next((t.device for t in model.parameters()), torch.device("cpu"))
    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, Tensor) else t, (args, kwargs))


def pipeline(model: nn.Module, mesh: Mesh, axis: str = "pp", *, microbatches: int, schedule: str = "1f1b",
             loss_fn: Callable[[Any, Tensor], Tensor] | None = None, split: Sequence[str] | None = None,
             chunks: int = 1, dp_axis: str | None = None, zero_stage: int = 0,
             checkpoint: bool | str = False, bucket_cap_mb: float = 25, release: bool = True,
             recv_ahead: int | None = None, recv_before_send: bool | None = None,
             autocast: torch.dtype | None = None, transport: str = "auto", example_inputs: Any = None,
             mixed_precision: MixedPrecision | None = None) -> Pipeline:
    """Pipeline ``model`` over ``axis`` of ``mesh`` with ``pp x chunks`` stages. Not collective (pure).

    ``model``: an ``nn.Sequential``, the reference GPT, or a model with a ``blocks`` ``nn.ModuleList`` (see
    ``stage.py`` for how each becomes units). ``split``: unit names that start stages 1, 2, ... (e.g.
    ``["blocks.2"]``); default: balanced by parameter count. ``schedule``: ``gpipe``, ``1f1b``, ``zb-h1``, ``zb-h2`` or
    ``interleaved`` (``chunks >= 2``). ``loss_fn(output, targets)`` runs on the last stage per micro-batch.
    ``dp_axis``: another mesh axis of data-parallel replicas of the whole pipeline; each takes its slice of
    the batch (every rank still passes the global batch), gradients and the loss are averaged over it; the
    gradient reduction of each stage starts inside its last backward action (bucketed, asynchronous).
    ``zero_stage=1|2|3``: ZeRO over ``dp_axis`` — build the optimizer with ``pipe.build_optimizer(factory)``; 2 also
    frees the full gradients after each step's reduction, 3 shards the parameters per unit (``zero3.py``).
    ``bucket_cap_mb``: gradient bytes per dp reduction (MB = 2**20 bytes). ``release``: free the parameters
    and buffers of the stages other ranks run (default), so each rank keeps ~1/pp of the model; ``model``
    itself is then no longer usable as a whole (use ``sw.full_state_dict(pipe)``).
    ``checkpoint``: activation checkpointing per unit — ``True``/``"full"`` (each block keeps only its input;
    recomputed in backward) or ``"selective"`` (each unit with attention keeps its weight matmuls' outputs and
    recomputes the rest); ``False``/``"none"`` for none.
    ``recv_ahead``: post each receive at least this many of the rank's compute actions before the one that
    consumes it; ``recv_before_send``: also before the action the rank runs when the message is sent (in the
    schedule's unit-cost simulation), so the transfer overlaps compute instead of stalling the receiver
    (``recv_ahead=0, recv_before_send=False``: just before the consumer; see ``communication.py``). Default
    (``None``): 1 and True on CPU (gloo); 0 and False on CUDA (NCCL queues a communicator's operations on one
    stream, where an early receive would hold up later sends; the CUDA path is not verified either way).
    Tensor parallelism inside a stage: pass a model already ``sw.parallelize``-d over another axis and a
    tp-aware ``loss_fn`` (e.g. ``vocab_parallel_cross_entropy``).
    ``autocast=torch.bfloat16``: every forward action (stage and ``loss_fn``) runs under ``torch.autocast`` on the
    mesh's device type; parameters, gradients and optimizer state keep their dtype (fp32 master weights).
    ``mixed_precision=sw.MixedPrecision()`` (with ``zero_stage`` 1-3 over a dp axis): bf16 parameters and gradients,
    fp32 master shards in the optimizer, gradients reduced in fp32 (``mixed.py``).
    ``transport``: how stage-to-stage messages travel. ``native``: the backend's isend/irecv (gloo, NCCL);
    ``shm``: a shared-memory channel per ordered pair of ranks (``comm/shm_p2p.py``: a send is a copy into the
    channel, no thread or socket in between) — CPU meshes whose pipeline ranks share one host; ``auto``
    (default): shm where it can run, else native. The host check runs at the first ``step`` (collective along
    the axis); with ``shm`` the loss broadcast goes through shared memory too.
    Bad input raises ``ValueError`` / ``TypeError`` before any communication.
    """
    return Pipeline(model, mesh, axis, microbatches=microbatches, schedule=schedule, loss_fn=loss_fn, split=split,
                    chunks=chunks, dp_axis=dp_axis, zero_stage=zero_stage, checkpoint=checkpoint,
                    bucket_cap_mb=bucket_cap_mb, release=release, recv_ahead=recv_ahead,
                    recv_before_send=recv_before_send, autocast=autocast, transport=transport,
                    example_inputs=example_inputs, mixed_precision=mixed_precision)
