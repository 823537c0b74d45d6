"""``sw.zero``: data parallelism with sharded optimizer state (stage 1), gradients (2) and parameters (3).

    model, opt = sw.zero(model, mesh, stage=2, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    loss_fn(model(x_local), y_local).backward()
    opt.clip_grad_norm_(1.0)          # optional: over the global norm
    opt.step()                        # consumes the gradients (zero_grad() is optional)

SBP view over ``axis``: the batch is ``S(0)``; optimizer state is ``S(0)`` of the flat parameter buffers
(stage >= 1); gradients come out of backward as ``P`` and are reduce-scattered to ``S(0)`` during backward
in every stage (stages 1-2: the gradient buckets of data parallelism, ``common/buckets.py``; stage 3: the
units), each bucket as soon as its gradients are ready (``grads.py``, one reducer for all stages);
parameters are ``B`` (stages 1-2: all-gathered after each step) or ``S(0)`` gathered to ``B`` only around
each unit's forward and backward (stage 3). Per-rank model-state bytes with fp32 Adam (Ψ parameters, N
ranks): stage 1 ``8Ψ + 8Ψ/N``, stage 2 ``4Ψ + 12Ψ/N``, stage 3 ``16Ψ/N``; with bf16/fp16 compute and fp32
master (``mixed_precision=MixedPrecision()``): ``4Ψ + 12Ψ/N``, ``2Ψ + 14Ψ/N``, ``16Ψ/N``.

What stage 1 keeps: full parameters (``B``), one persistent full gradient buffer per bucket (4Ψ in fp32,
``param.grad`` are views of it while gradients accumulate) and the optimizer state of this rank's shard
only. The averaged gradient shard of a synchronised backward is written into the gradient buffer's own
slice (no extra memory; ``param.grad`` is ``None`` afterwards and the rest of the buffer holds the
reduction's scratch until the next backward or step overwrites it); only with
``MixedPrecision(reduce_dtype=...)`` different from the compute dtype is the shard kept apart, from the
backward to the step (``4Ψ/N`` more in that dtype). Stage 2 frees each bucket's full gradients as soon as
its reduce-scatter starts and keeps only the shard.

Gradient accumulation: backwards without a step accumulate (as in plain PyTorch); every stage reduces each
backward unless it ran inside ``model.no_sync()``, which keeps full local gradients and defers the
reduction to the next backward outside it (stage 1 accumulates into its buffers, then re-averages the
whole sum). ``step()``/``clip_grad_norm_()`` inside ``no_sync()``, or with unreduced local gradients, raise
``RuntimeError``. A backward after ``clip_grad_norm_`` but before ``step()`` raises (the clipped gradients
would silently mix with new ones).

Tensor parallelism inside: ``sw.zero(sw.parallelize(model, mesh, plan, axis="tp"), mesh, axis="dp", ...)`` shards each
tp rank's local (already tp-sharded) parameters over ``axis`` only; every ZeRO collective runs on the ``axis`` group
of the rank's tp coordinate, the tp collectives stay the tp model's; ``clip_grad_norm_`` counts tp-replicated
parameters once (``common/grad_norm.py``); ``full_state_dict`` gathers over ``axis`` and then over tp.

Collectives: ``algorithm`` picks the reduce-scatter and all-gather implementation (``comm``); the default
(``None``) is ``"ring"`` on CPU meshes — gloo's own reduce-scatter is 2-3x slower than the ring on
0.25-12 MB buckets — and ``"native"`` on CUDA (NCCL), or for dtypes the ring does not take.

Collective calls: ``sw.zero`` (checks and a broadcast from coordinate 0), every forward and backward in
stage 3, every synchronised backward, ``step``, ``clip_grad_norm_``, ``full_state_dict``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ...mesh import Mesh
from ..common.buckets import default_order, plan_buckets
from ..common.expert_tag import is_expert_param
from ..common.materialize import ensure_sources, materialize, needs_broadcast
from ..common.memory import PeakTracker, storage_bytes
from ..common.mixed_precision import LossScaler, MixedPrecision
from ..data.replicas import broadcast_coalesced, check_replicas_agree, trainable
from .expert_pieces import gather_expert, gather_master, local_value
from ..tensor.apply_plan import full_tensor
from .flat import FlatGroup
from .grads import ShardGradReducer
from .optim import OptimizerFactory, ZeroOptimizer
from .offload import GradientToHost, Offload, check_offload
from .options import Algorithm, check_inputs, default_algorithm
from .stage3 import Stage3Runtime, default_units, unit_module
from .units import build_units

__all__ = ["zero", "ZeroModel", "ZeroOptimizer", "MixedPrecision"]

def zero(model: nn.Module, mesh: Mesh, *, stage: int, optimizer: OptimizerFactory, axis: str = "dp",
         mixed_precision: MixedPrecision | None = None, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
         units: Sequence[Sequence[str]] | None = None, prefetch: bool = True,
         overlap: bool = True, algorithm: Algorithm | None = None,
         offload: Offload | None = None) -> tuple["ZeroModel", ZeroOptimizer]:
    """Wrap ``model`` for ZeRO ``stage`` over ``axis`` and build ``optimizer(shard_params)`` on this rank's
    shards. Returns ``(model, opt)``; use ``opt`` instead of an optimizer over ``model.parameters()``.

    ``optimizer``: a factory such as ``functools.partial(torch.optim.AdamW, lr=1e-3)``. ``bucket_cap_mb``
    / ``first_bucket_mb``: gradient bucket sizes of stages 1-2 (MB = 2**20 bytes). ``units`` (stage 3):
    lists of module names gathered together, in forward order (default: each element of ``blocks``; the
    remaining parameters form one more unit). ``prefetch``: gather the next unit while the current one
    computes. ``overlap``: start a group's reduce-scatter as soon as its gradients are ready (else all when
    backward ends). ``algorithm``: ``native | ring | tree | shm | auto`` for the reduce-scatters and all-gathers
    (``None``: ``default_algorithm``). ``offload``: ``"optimizer"`` keeps the fp32 master shards and the optimizer
    state in host memory and steps there; ``"params"`` (stage 3) also the parameter shards (``offload.py``; on a
    CPU mesh the same numbers and bytes as without). Collective (every rank of the axis calls it with the same
    model structure and options).
    """
    wrapped = ZeroModel(model, mesh, axis=axis, stage=stage, mixed_precision=mixed_precision,
                        bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb, units=units,
                        prefetch=prefetch, overlap=overlap, algorithm=algorithm, offload=offload)
    opt = ZeroOptimizer(wrapped, optimizer, wrapped.groups, mesh, axis, stage=stage, scaler=wrapped.scaler,
                        reduce_dtype=wrapped.reduce_dtype, to_host=wrapped.to_host)
    wrapped._optimizer = opt
    return wrapped, opt


class ZeroModel(nn.Module):
    """The model half of ``sw.zero`` (see module docstring). ``module`` is the user's model."""

    def __init__(self, module: nn.Module, mesh: Mesh, *, axis: str, stage: int,
                 mixed_precision: MixedPrecision | None, bucket_cap_mb: float, first_bucket_mb: float,
                 units: Sequence[Sequence[str]] | None, prefetch: bool, overlap: bool,
                 algorithm: Algorithm | None = None, offload: Offload | None = None) -> None:
        check_inputs(module, mesh, axis, stage, bucket_cap_mb, first_bucket_mb, mixed_precision, algorithm)
        check_offload(offload, stage)
        super().__init__()
        self.module, self.mesh, self.axis, self.stage = module, mesh, axis, stage
        self.offload = offload
        self.to_host = GradientToHost(mesh.device) if offload else None
        self.mixed_precision = mixed_precision
        # A meta-device model: each rank draws what it keeps from the same sources (stage 3: its flat shards
        # only), so only tensors that were already real need coordinate 0's values.
        ensure_sources(module)
        check_replicas_agree(module, mesh, axis)  # includes the sources' seeds
        real = [t for t in (*module.parameters(), *module.buffers()) if needs_broadcast(t)]
        if stage < 3:
            materialize(module, mesh.device)
        broadcast_coalesced(real, mesh, axis, src=0)
        named = trainable(module)
        self.compute_dtype = mixed_precision.param_dtype if mixed_precision else named[0][1].dtype
        self.reduce_dtype = (mixed_precision.reduce_dtype or self.compute_dtype) if mixed_precision else self.compute_dtype
        self.scaler = LossScaler(mixed_precision)
        self.algorithm: str = algorithm or default_algorithm(mesh, [self.compute_dtype, self.reduce_dtype])
        self._sync = True
        self._grads_reduced = False
        self._optimizer: ZeroOptimizer | None = None
        self._peak = PeakTracker(mesh.device)
        self._full_grads: list[torch.Tensor] = []
        self._reducer: ShardGradReducer | None = None
        self._launch_pos: list[int] = []  # group k is the reducer's group _launch_pos[k]
        self._stage3: Stage3Runtime | None = None
        self.frozen_groups: list[FlatGroup] = []  # stage 3: the frozen parameters' shards (units.py)
        self.last_step_bytes: dict[str, int] = {}
        if stage == 3:
            self._build_stage3(named, units, prefetch, overlap)
        else:
            self._build_stage12(named, bucket_cap_mb, first_bucket_mb, overlap)
        self._cast_the_rest()
        for g in self.groups:
            for p in g.params:
                p.register_post_accumulate_grad_hook(self._guard_hook)
        module._shardwise_zero = True  # type: ignore[assignment]
        self._shardwise_zero = True

    # -- construction -----------------------------------------------------------------------------------
    def _group(self, named: list[tuple[str, nn.Parameter]], sharded: bool) -> FlatGroup:
        return FlatGroup([n for n, _ in named], [p for _, p in named], self.mesh, self.axis,
                         compute_dtype=self.compute_dtype, sharded_params=sharded, algorithm=self.algorithm,
                         offload=self.offload)

    def _build_stage12(self, named: list[tuple[str, nn.Parameter]], cap_mb: float, first_mb: float,
                       overlap: bool) -> None:
        # Buckets in the order backward produces gradients (reverse registration): the launch order.
        size = torch.empty(0, dtype=self.compute_dtype).element_size()
        plan = plan_buckets([p.numel() * size for _, p in named], [0] * len(named),
                            cap_bytes=max(1, int(cap_mb * 2**20)), first_cap_bytes=max(1, int(first_mb * 2**20)),
                            order=default_order(len(named)))
        self.groups = [self._group([named[i] for i in sorted(bucket)], sharded=False) for bucket in plan.buckets]
        if self.stage == 1:  # the persistent full gradient buffers (param.grad views while accumulating)
            self._full_grads = [torch.zeros(g.layout.total, dtype=self.compute_dtype, device=self.mesh.device)
                                for g in self.groups]
        self._make_reducer(self.groups, overlap, on_launched=None, on_end=None)

    def _make_reducer(self, launch: list[FlatGroup], overlap: bool, on_launched: Any, on_end: Any) -> None:
        self._launch_pos = [next(j for j, h in enumerate(launch) if h is g) for g in self.groups]
        self._reducer = ShardGradReducer(launch, self.mesh, self.axis, reduce_dtype=self.reduce_dtype,
                                         algorithm=self.algorithm, overlap=overlap,
                                         full_grads=self._full_grads or None,
                                         on_launched=on_launched, on_backward_end=on_end,
                                         on_stored=self._stored if self.to_host is not None else None)

    def _stored(self, k: int) -> None:
        """Offload: group k (launch order) has its averaged shard: start its copy to the host master's grad."""
        r = self._reducer
        assert r is not None and self.to_host is not None
        self.to_host.stored(r.groups[k], r.groups[k].master, r.shard(k))

    def _build_stage3(self, named: list[tuple[str, nn.Parameter]], units: Sequence[Sequence[str]] | None,
                      prefetch: bool, overlap: bool) -> None:
        names = [list(u) for u in (default_units(self.module) if units is None else units)]
        unit_modules = [[unit_module(self.module, n) for n in unit] for unit in names]
        dtype = named[0][1].dtype  # frozen parameters of another dtype (a quantised base) stay whole
        frozen = [(n, p) for n, p in self.module.named_parameters()
                  if not p.requires_grad and not is_expert_param(p) and p.dtype == dtype]
        built, kept, has_rest = build_units(self.module, unit_modules, named, frozen,
                                            lambda ps: self._group(ps, sharded=True))
        self.groups = [u.trainable for u in built if u.trainable is not None]
        self.frozen_groups = [u.frozen for u in built if u.frozen is not None]
        materialize(self.module, self.mesh.device)  # what no group holds: buffers, frozen tensors of other dtypes
        self._stage3 = runtime = Stage3Runtime(self.module, built, kept, has_rest=has_rest, prefetch=prefetch)
        # Backward meets the units in reverse forward order; the rest unit (embeddings) finishes last.
        first = 1 if has_rest else 0
        order = [k for k in [*range(len(built) - 1, first - 1, -1), *([0] if has_rest else [])]
                 if built[k].trainable is not None]

        def launched(j: int) -> None:
            if order[j] >= first:
                runtime.launched(order[j])
        self._make_reducer([built[k].trainable for k in order], overlap,  # type: ignore[misc]
                           on_launched=launched, on_end=runtime.free_all)

    @property
    def flat_groups(self) -> list[FlatGroup]:
        """Every flat group holding parameter values: the trainable ``groups``, then stage 3's frozen ones."""
        return [*self.groups, *self.frozen_groups]

    def _cast_the_rest(self) -> None:
        """Mixed precision: frozen parameters and floating buffers compute in the compute dtype too."""
        if self.mixed_precision is None:
            return
        managed = {id(p) for g in self.flat_groups for p in g.params}
        for t in [*self.module.parameters(), *self.module.buffers()]:
            if id(t) not in managed and t.is_floating_point():
                t.data = t.data.to(self.compute_dtype)

    def _guard_hook(self, _param: torch.Tensor) -> None:
        if self._grads_reduced:
            raise RuntimeError("ZeRO: a backward ran after the gradients were prepared for the step "
                               "(clip_grad_norm_) and before step(); call step() first, or clip after the "
                               "last backward of the step")

    # -- running ----------------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (stage 3: collective — it gathers parameters)."""
        if self._reducer is not None and torch.is_grad_enabled():
            self._reducer.prepare_forward(sync=self._sync)
        if self.mixed_precision is not None:
            args, kwargs = tree_map(self._cast_input, (args, kwargs))
        return self.module(*args, **kwargs)

    def _cast_input(self, x: Any) -> Any:
        return x.to(self.compute_dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards of forwards run inside keep full local gradients and do not communicate (stages
        2-3); the next backward outside reduces the sum. ``step()`` inside raises. Local."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as the ZeRO optimizer's ``zero_grad()``: zero the gradient buffers this wrapper keeps."""
        if self._optimizer is not None:
            self._optimizer.zero_grad(set_to_none)
        else:
            self._zero_grads()

    def _zero_grads(self) -> None:
        assert self._reducer is not None
        self._reducer.clear()  # param.grad = None; the buffers are overwritten by the next backward

    def _note_peak(self, opt: ZeroOptimizer | None) -> None:
        self._peak.note(sum(storage_bytes(self.memory_tensors(opt)).values()))

    # -- ``ZeroGroups`` (what ``ZeroOptimizer`` reads; all local) -----------------------------------------
    @property
    def full_grads(self) -> list[torch.Tensor]:
        """Stage 1: each group's full gradient buffer; after a synchronised backward its slice ``[lo, hi)``
        holds the averaged shard and the rest the reduction's scratch (see the module docstring);
        else empty."""
        return list(self._full_grads)

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's averaged gradient shard of each group (indexed like ``groups``; zeros for a group not
        reduced since the last step). Stage 1: a view of the full buffer's slice where dtypes agree."""
        assert self._reducer is not None
        return [self._reducer.shard(j) for j in self._launch_pos]

    @property
    def reduce_every_pass(self) -> bool:
        """Stages 2-3: a training loop should reduce every backward of an accumulated step rather than run the
        earlier ones under ``no_sync`` — that keeps whole local gradients until the last, the memory these stages
        exist to save (each reduction adds into the shards instead: one reduce-scatter per pass)."""
        return self.stage >= 2

    @property
    def syncing(self) -> bool:
        """False inside ``no_sync()``."""
        return self._sync

    @property
    def has_unreduced_grads(self) -> bool:
        """Gradients accumulated under ``no_sync()`` not reduced by a synchronised backward yet."""
        return self._reducer is not None and self._reducer.unreduced

    def set_grads_prepared(self, prepared: bool) -> None:
        """Set by the optimizer: while True a backward raises (``_guard_hook``)."""
        self._grads_reduced = prepared

    def clear_grads(self) -> None:
        """Zero the gradient buffers in place (what ``ZeroOptimizer.zero_grad`` does to the model)."""
        self._zero_grads()

    def after_step(self) -> None:
        """Note the model-state memory peak after an optimizer step, and the bytes of the gradient shards while
        they still exist (``last_step_bytes``: the step releases them next)."""
        held = self._reducer.held_shards() if self._reducer is not None else []
        self.last_step_bytes = storage_bytes({"grads": held})
        self._note_peak(self._optimizer)

    def offloaded_tensors(self, opt: ZeroOptimizer | None = None) -> list[torch.Tensor]:
        """The tensors ``offload`` keeps in host memory: the master shards and the optimizer state (with
        ``params``, the compute shards too); empty without offload. On a CPU mesh host and device are one
        memory: these are the bytes an accelerator would hold on its host. Local."""
        if not self.offload:
            return []
        out = [g.master for g in self.flat_groups] + ([g.shard for g in self.flat_groups] if self.offload == "params" else [])
        return out + [v for s in (opt.optimizer.state.values() if opt is not None else [])
                      for v in s.values() if isinstance(v, torch.Tensor)]

    def memory_tensors(self, opt: ZeroOptimizer | None = None) -> dict[str, list[torch.Tensor]]:
        """Tensors this rank keeps for the model state, by category (for ``sw.memory_report``)."""
        managed = {id(p) for g in self.flat_groups for p in g.params}
        params = [t for g in self.flat_groups for t in (g.full, g.master, g.shard)]
        params += [p for p in self.module.parameters() if id(p) not in managed]
        grads = [*self._full_grads, *(self._reducer.held_shards() if self._reducer is not None else [])]
        grads += [p.grad for p in self.module.parameters() if p.grad is not None]
        grads += [g.master.grad for g in self.groups if g.master.grad is not None]
        state = [v for s in (opt.optimizer.state.values() if opt is not None else [])
                 for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": params, "grads": grads, "optimizer": state}

    # -- checkpoints: the plain model's keys, full tensors ----------------------------------------------
    # With tensor parallelism inside (``sw.zero(sw.parallelize(model, mesh, ..., axis="tp"), mesh, axis="dp")``)
    # each flat group holds this tp rank's *local* shards: gathering over ``axis`` gives the local tensors, and
    # a tp-split one is then gathered over tp (``full_tensor``) or cut from a full one (``local_piece``).
    @torch.no_grad()
    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's pieces of the plain model's tensors (master precision; the tp shard of a tp-split
        parameter, the whole tensor otherwise), each flat group gathered over ``axis``. Collective over it."""
        value: dict[int, torch.Tensor] = {}
        for g in self.flat_groups:
            full = gather_master(g)  # (L,): every dp shard of the group
            for p, v in zip(g.params, g.views(full)):
                value[id(p)] = v.clone()
        return {key: value[id(t)] if id(t) in value else t.detach().clone()
                for key, t in self.module.state_dict(keep_vars=True).items()}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded tensors (master precision) under the unwrapped model's keys. Collective (over
        ``axis``, and over the tensor-parallel axes of the model)."""
        tensors = self.module.state_dict(keep_vars=True)
        out = {}
        for key, v in self.local_state_dict().items():
            expert = gather_expert(tensors[key])  # an expert piece: every ep rank's rows (not in any group)
            out[key] = expert if expert is not None else full_tensor(tensors[key], v)
        return out

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        """Same as ``full_state_dict()`` (collective): checkpoints load into any stage and world size."""
        return self.full_state_dict()

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a *full* state dict (the plain model's keys) into any stage and world size (a tp-split tensor:
        this rank's piece is cut from it). Local: every rank passes the same dict. Raises ``ValueError`` for
        missing/unexpected keys or wrong shapes."""
        keys = {k: t for k, t in self.module.state_dict(keep_vars=True).items()}
        missing = sorted(set(keys) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(keys))
        if strict and (missing or unexpected):
            raise ValueError(f"state dict does not match the model: missing {missing}, unexpected {unexpected}; "
                             f"pass a full state dict of the unwrapped model (sw.full_state_dict)")
        by_id = {id(t): k for k, t in keys.items() if k in state_dict}
        for g in self.flat_groups:
            if not strict and not any(id(p) in by_id for p in g.params):
                continue  # a group the dict leaves out entirely (a checkpoint without the frozen base) keeps its values
            values = []
            for name, p, shape in zip(g.names, g.params, g.shapes):
                v = local_value(p, state_dict[by_id[id(p)]]) if id(p) in by_id else None
                if v is None or tuple(v.shape) != tuple(shape):
                    raise ValueError(f"parameter {name!r}: expected shape {tuple(shape)} (this rank's piece), got "
                                     f"{None if v is None else tuple(v.shape)}")
                values.append(v)
            g.load_full(values)
        managed = {id(p) for g in self.flat_groups for p in g.params}
        for k, t in keys.items():
            if id(t) not in managed and k in state_dict:
                t.copy_(local_value(t, state_dict[k]))
        return None
