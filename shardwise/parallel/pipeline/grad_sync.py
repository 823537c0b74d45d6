"""Data parallelism around a pipeline: reduce each stage's gradients over the dp axis once per step, started
as soon as they are final, while the rest of the schedule still runs.

A pipeline rank's gradients of stage ``s`` are final after the last action that produces them in this step:
the last ``B`` of ``s`` (schedules that do not split backward) or its last ``W`` (zero-bubble schedules). The
interpreter tells ``DpGradSync`` when that action starts (``arm``) and ends (``stage_done``). Gradients live
as views of one flat buffer per bucket (``zero_flat.FlatGroup`` lays the parameters end to end), so a
bucket's collective runs on the buffer itself, without a copy:

* full backward: a post-accumulate-grad hook per parameter marks it ready during the armed action, and a
  bucket whose parameters are all ready starts its collective at once — inside the last backward, in the
  order autograd produces the gradients (buckets are cut in reverse registration order);
* split backward: ``W`` writes the gradients without autograd's accumulation hooks, so the buckets of ``s``
  start when its last ``W`` ends. With chunks > 1 this still overlaps stage ``s``'s reduction with the other
  chunk's remaining work; on the last stage's rank (which finishes first) it overlaps with every upstream
  rank's cool-down.

The collective is ``avg`` over dp: an all-reduce (plain data parallelism: every replica keeps the averaged
gradient) or, with ``zero=True`` (ZeRO stage 1), a reduce-scatter that leaves each replica only its shard
of the averaged gradient; the sharded optimizer (``ZeroOptimizer`` over the same ``FlatGroup``s) steps the
shard and all-gathers the parameters. Parameters shared with another pipeline rank (tied embedding/head)
sit in their own buckets, started by ``finish`` only after the tied-gradient exchange. Every dp replica of
one pipeline coordinate runs the same action list, so buckets start in the same order everywhere.

Expert-parallel parameters (tagged by ``parallel.expert.shard_experts``) hold different experts on the dp ranks
of one expert group: they are in no bucket (an average over dp would mix different experts); their gradients
are summed over the ranks holding the same experts by ``parallel.expert.grads.ExpertGradSync``, which the
caller runs after the step's last ``pipe.step`` (once per optimizer step, accumulation included).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from ... import comm
from ...mesh import Mesh
from ..common.expert_tag import expert_shard_of, is_expert_param
from ..zero.flat import FlatGroup
from ..zero.grads import attach_full_grads
from ..zero.options import default_algorithm

__all__ = ["DpGradSync", "PipelineZeroGroups", "plan_stage_buckets", "expert_counted"]


def expert_counted(q: nn.Parameter, pp_axis: str) -> bool:
    """Whether this rank counts the expert piece ``q``'s gradient in a whole-model norm (after its
    ``ExpertGradSync``): on coordinate 0 of every axis of its expert mesh but the expert axis and the pipeline
    axis — the ranks that hold the same experts hold the same averaged gradient. Pure."""
    shard = expert_shard_of(q)
    return all(a in (shard.axis, pp_axis) or shard.mesh.coord(a) == 0 for a in shard.mesh.axes)


def plan_stage_buckets(numels: Sequence[int], cap_elems: int) -> list[list[int]]:
    """Indices of one stage's parameters grouped into buckets of at most ``cap_elems`` elements (a larger
    parameter is a bucket of its own), walking the parameters in reverse: backward produces the last
    layer's gradients first, so the first bucket completes first. Pure."""
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(numels))):
        if not buckets or size + numels[i] > cap_elems:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += numels[i]
    return [sorted(b) for b in buckets]


class _Bucket:
    def __init__(self, group: FlatGroup, stage: int | None, release: bool) -> None:
        self.group, self.stage = group, stage
        self.dtype, self.device = group.compute_dtype, group.mesh.device
        # (L,) flat gradients; ZeRO-2/3 (``release``) allocate them when a step needs them and free them after the
        # reduce-scatter, so between steps (and at the optimizer step) only the shard lives
        self.grads: torch.Tensor | None = None if release else torch.zeros(group.layout.total, dtype=self.dtype,
                                                                            device=self.device)
        self.ready: set[int] = set()
        self.handle: comm.Handle | None = None
        self.shard: torch.Tensor | None = None  # zero: this rank's averaged gradient shard after ``finish``
        self.dirty = False  # ZeRO-1: ``shard`` is a view of ``grads``, which the reduction left partly summed


class DpGradSync:
    """Bucketed, overlapped gradient averaging over ``dp_axis`` for this rank's stages (see module doc).

    ``stage_params``: local stage index -> its (name, parameter) pairs in registration order (a parameter
    used by two local stages is listed under the first). ``late``: ids of parameters whose collective waits
    for ``finish`` (tied ones). Collective only in ``arm``/``stage_done``/``finish``.
    """

    def __init__(self, stage_params: dict[int, list[tuple[str, nn.Parameter]]], mesh: Mesh, dp_axis: str, *,
                 zero: bool, late: set[int], cap_bytes: int = 25 * 2**20, stage: int = 1,
                 units: Callable[[int, list[nn.Parameter]], list[list[int]]] | None = None,
                 compute_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None) -> None:
        self.mesh, self.axis, self.zero = mesh, dp_axis, zero
        self.stage = stage if zero else 0
        """ZeRO stage: 0 (all-reduce), 1 (full buffers kept), 2-3 (full buffers freed after each reduction)."""
        self.release = self.stage >= 2
        # ZeRO-3: ``units(stage, kept parameters)`` -> indices of each unit's group (one bucket per unit)
        dtypes = sorted({q.dtype for named in stage_params.values() for _, q in named}, key=str)
        # mixed precision (``mixed.py``): bf16 full buffers, gradients reduced in ``reduce_dtype``
        self.compute_dtype, self.reduce_dtype = compute_dtype, reduce_dtype
        dtypes = dtypes if compute_dtype is None else sorted({compute_dtype, reduce_dtype or compute_dtype}, key=str)
        # ZeRO-1's reduce-scatter and parameter all-gather run what ``sw.zero`` runs (on CPU our ring: gloo's own
        # reduce-scatter is 2-3x slower at bucket sizes); the plain all-reduce stays the backend's
        self.algorithm = default_algorithm(mesh, dtypes) if zero else "native"
        self.buckets: list[_Bucket] = []
        late_named: list[tuple[str, nn.Parameter]] = []
        for s, named in sorted(stage_params.items()):
            dense = [(n, q) for n, q in named if q.requires_grad and not is_expert_param(q)]  # see module doc
            kept = [(n, q) for n, q in dense if id(q) not in late]
            late_named += [(n, q) for n, q in dense if id(q) in late]
            if not kept:
                continue
            cap = max(1, cap_bytes // kept[0][1].element_size())
            plan = units(s, [q for _, q in kept]) if units is not None else plan_stage_buckets([q.numel() for _, q in kept], cap)
            for idx in plan:
                self.buckets.append(self._bucket([kept[i] for i in idx], s))
        if late_named:
            self.buckets.append(self._bucket(late_named, None))
        self._of: dict[int, _Bucket] = {id(q): b for b in self.buckets for q in b.group.params}
        self._armed: set[int] = set()
        for b in self.buckets:
            for q in b.group.params:
                q.register_post_accumulate_grad_hook(self._on_grad)
        self.launched_in_backward = 0
        """Buckets whose collective started from a gradient hook, inside a backward (diagnostics/tests)."""
        self.syncing = True
        """False inside ``Pipeline.no_sync``: steps accumulate without reducing."""
        self.unreduced = False
        """A step under ``no_sync`` added gradients that no reduction has averaged yet."""

    def _bucket(self, named: list[tuple[str, nn.Parameter]], stage: int | None) -> _Bucket:
        params = [q for _, q in named]
        group = FlatGroup([n for n, _ in named], params, self.mesh, self.axis,
                          compute_dtype=self.compute_dtype or params[0].dtype,
                          sharded_params=self.stage == 3, algorithm=self.algorithm)
        return _Bucket(group, stage, self.release)

    @property
    def groups(self) -> list[FlatGroup]:
        return [b.group for b in self.buckets]

    # -- the step -------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Point every gradient at its bucket view (keeping any accumulated value), reset readiness. ZeRO-2:
        allocate the full buffers (zeros); ZeRO-3 allocates a unit's when its first backward starts (``prepare``).
        ZeRO keeps the shards of earlier steps (accumulation adds each step's averaged shard to them)."""
        for b in self.buckets:
            if b.dirty:  # ZeRO-1 accumulating a second reduced step: the shard moves out, the buffer restarts
                b.shard, b.dirty = b.shard.clone(), False  # type: ignore[union-attr]
                b.grads.zero_()  # type: ignore[union-attr]
            if self.stage != 3:
                self.prepare(b)
            b.ready.clear()
            b.handle = None
        self._armed.clear()
        self.launched_in_backward = 0

    def prepare(self, b: _Bucket) -> None:
        """Give bucket ``b`` its full flat gradient buffer for this step (zeros) and point ``.grad`` at it."""
        if b.grads is None:
            b.grads = torch.zeros(b.group.layout.total, dtype=b.dtype, device=b.device)
        if self.stage == 3:
            _attach_sharded(b.group, b.grads)
        else:
            attach_full_grads(b.group, b.grads)

    def prepare_group(self, group: FlatGroup) -> None:
        """ZeRO-3: the unit ``group`` is about to run a backward; its gradient buffer must exist."""
        b = self._of[id(group.params[0])]
        if b.grads is None:
            self.prepare(b)

    def arm(self, stage: int) -> None:
        """The next action is the last one producing stage ``stage``'s gradients this step."""
        self._armed.add(stage)

    def _on_grad(self, q: torch.Tensor) -> None:
        b = self._of[id(q)]
        if b.stage not in self._armed or b.handle is not None:
            return
        b.ready.add(id(q))
        if len(b.ready) == len(b.group.params):
            self._launch(b)
            self.launched_in_backward += 1

    def stage_done(self, stage: int) -> None:
        """Stage ``stage``'s gradients are final: start every bucket of it not started yet."""
        self._armed.discard(stage)
        for b in self.buckets:
            if b.stage == stage and b.handle is None:
                self._launch(b)

    def _launch(self, b: _Bucket) -> None:
        self.prepare(b)  # a gradient autograd replaced instead of accumulating: copied back (or a unit never run)
        if self.zero:
            cast = self.reduce_dtype not in (None, b.dtype)
            src = b.grads.to(self.reduce_dtype) if cast else b.grads  # type: ignore[union-attr]
            b.handle = comm.reduce_scatter(  # type: ignore[assignment]
                src, self.mesh, self.axis, op="avg", algorithm=self.algorithm, async_op=True,  # type: ignore[arg-type]
                scratch=True)  # works in the buffer itself (or its cast copy): no full-size working copy
        else:
            b.handle = comm.all_reduce(b.grads, self.mesh, self.axis, op="avg", async_op=True)  # type: ignore[assignment]

    def finish(self) -> None:
        """Start the late buckets (after the tied exchange) and any bucket of a stage that ran no backward,
        then wait for all. Afterwards ``.grad`` holds the dp average (all-reduce), or (ZeRO) each bucket's ``shard``
        holds this rank's shard of it — added to the shard of an earlier ``pipe.step`` of the same optimizer step
        (accumulation) — and the full buffer, which the reduce-scatter worked in, is zeroed (ZeRO-1) or freed."""
        self.unreduced = False
        for b in self.buckets:
            if b.handle is None:
                self._launch(b)
        for b in self.buckets:
            got = b.handle.wait()  # type: ignore[union-attr]
            b.handle = None  # a finished handle still holds its working buffers (our ring's full-size copy)
            if not self.zero:
                continue
            inside = got.untyped_storage().data_ptr() == b.grads.untyped_storage().data_ptr()  # type: ignore[union-attr]
            whole = got.untyped_storage().nbytes() == got.numel() * got.element_size()
            if b.shard is not None:  # an accumulated step adds its own average
                b.shard.add_(got)
            elif inside and not self.release:  # ZeRO-1: the shard stays where the reduction left it (no copy)
                b.shard, b.dirty = got, True
            else:  # a view of a buffer about to go (ZeRO-2/3) or of a working copy: kept alone
                b.shard = got if whole and not inside else got.clone()
            if self.release:  # ZeRO-2/3: the shard is all that stays
                self._free_full(b)

    def _free_full(self, b: _Bucket) -> None:
        """Drop the full gradient buffer and every ``.grad`` view of it (ZeRO-2/3, after the reduction)."""
        for q in b.group.params:
            q.grad = None
        b.grads = None

    # -- ZeRO-1's optimizer view ------------------------------------------------------------------------
    def shard_grads(self) -> list[torch.Tensor]:
        """ZeRO-1: this rank's shard of each bucket's averaged gradient (zeros before any step)."""
        for b in self.buckets:
            if b.shard is None:
                b.shard = torch.zeros(b.group.hi - b.group.lo, dtype=self.reduce_dtype or b.dtype, device=b.device)
        return [b.shard for b in self.buckets]  # type: ignore[misc]

    def held_shards(self) -> list[torch.Tensor | None]:
        """ZeRO-1: each bucket's averaged gradient shard if this step produced one, else None (no allocation,
        unlike ``shard_grads``: for inspecting what a rank holds, e.g. the non-finite guard). Local."""
        return [b.shard for b in self.buckets]

    @property
    def full_grads(self) -> list[torch.Tensor]:
        """Each bucket's full flat gradient buffer (the parameters' ``.grad`` are views of it); ZeRO-2/3: only
        those that exist now (between steps none). Local."""
        return [b.grads for b in self.buckets if b.grads is not None]

    @torch.no_grad()
    def zero_grads(self) -> None:
        for b in self.buckets:
            b.shard, b.dirty = None, False
            if self.release:
                self._free_full(b)
                continue
            b.grads.zero_()  # type: ignore[union-attr]
            attach_full_grads(b.group, b.grads)  # type: ignore[arg-type]


@torch.no_grad()
def _attach_sharded(group: FlatGroup, buffer: torch.Tensor) -> None:
    """``attach_full_grads`` for ZeRO-3 units, whose parameters may be freed (empty) right now: a gradient already
    pointing into ``buffer`` stays, another is copied in; a freed parameter gets no ``.grad`` (its values are in
    ``buffer``, about to be reduced)."""
    for p, view in zip(group.params, group.views(buffer)):
        if p.grad is not None and p.grad.data_ptr() == view.data_ptr():
            continue
        view.copy_(p.grad) if p.grad is not None else view.zero_()
        p.grad = view if p.shape == view.shape else None


class PipelineZeroGroups:
    """``ZeroGroups`` over a pipeline's dp gradient buckets (ZeRO inside ``sw.pipeline``), for ``ZeroOptimizer``'s
    stage-2 path: the shards are already averaged by ``DpGradSync.finish``; ``Pipeline.no_sync`` steps leave
    gradients unreduced, which the optimizer refuses to step.
    ``extra``: parameters outside the buckets that the inner optimizer also steps (expert-parallel ones, with
    their own per-parameter gradients): cleared with the buckets. Local."""

    def __init__(self, sync: DpGradSync, extra: Sequence[nn.Parameter] = ()) -> None:
        self.sync, self.extra = sync, list(extra)

    @property
    def groups(self) -> list[FlatGroup]:
        return self.sync.groups

    @property
    def full_grads(self) -> list[torch.Tensor]:
        return self.sync.full_grads

    @property
    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's averaged shard of each bucket (zeros for a bucket no step reduced yet)."""
        return self.sync.shard_grads()

    @property
    def syncing(self) -> bool:
        return self.sync.syncing

    @property
    def has_unreduced_grads(self) -> bool:
        return self.sync.unreduced

    def set_grads_prepared(self, prepared: bool) -> None:
        """Nothing to guard: a backward can only run inside ``pipe.step``, which resets the buckets."""

    def clear_grads(self) -> None:
        self.sync.zero_grads()
        self.sync.unreduced = False
        for q in self.extra:
            q.grad = None

    def after_step(self) -> None:
        """No memory peak is tracked for a pipeline's optimizer."""
