"""Gradient reduction for ZeRO: full gradients (``P`` over the axis) become averaged shards (``S(0)``).

One reducer, ``ShardGradReducer``, serves every stage. It runs a bucket plan (stages 1-2: the buckets of
``common/buckets.py``, the plan data parallelism uses; stage 3: the units) *during* backward: every
parameter has a post-accumulate-grad hook; when all parameters of a group hold their gradient, the group's
asynchronous averaging reduce-scatter starts while backward goes on with earlier layers. Groups are
launched strictly in launch order so that every rank issues the same collectives in the same sequence; a
callback queued on the autograd engine launches what is left (groups with unused parameters contribute
zeros), waits, and stores the averaged shards before ``backward()`` returns. Repeated backwards without a
step accumulate, as in plain PyTorch. Stage 1 and stages 2-3 differ only in what survives a reduction:

* stage 1 (``full_grads`` given: one persistent flat buffer per group, ``param.grad`` are views of it while
  gradients accumulate): the averaged shard is written into the buffer's own slice ``[lo, hi)``, so no
  shard-sized memory is added; the reduction works in the buffer itself (no bucket-sized copy), so outside
  the slice it holds scratch — partial sums no one reads as gradients — until the next backward or step
  overwrites it. ``param.grad`` is ``None`` after a synchronised backward. A later
  backward before the step accumulates on top: a parameter whose view holds the averaged slice contributes
  ``N * average`` (its share of the sum) plus its new gradient, so the next reduce-scatter averages the whole
  accumulation. Where the reduce dtype differs from the buffer's (``MixedPrecision(reduce_dtype=...)``) the
  shard is kept apart instead (``Ψ/N`` more elements in that dtype) and the buffer keeps the local sum.
* stages 2-3 (no ``full_grads``): a group's gradients are flattened into a new tensor, the full
  ``param.grad`` are dropped (no full-size gradient survives its reduction) and the averaged result is added
  into a persistent shard buffer (the first reduction after a step is copied into it: no zeroing).

``no_sync``: backwards of forwards run inside it keep full gradients locally (no communication; stages 2-3
hold full gradient memory meanwhile); the next synchronised backward reduces the accumulated sum. Stepping
while local gradients are unreduced raises instead of silently dropping them.
"""

from __future__ import annotations

from typing import Callable

import torch

from ... import comm
from ...mesh import Mesh
from .flat import FlatGroup

__all__ = ["ShardGradReducer", "attach_full_grads"]

MAX_IN_FLIGHT = 1
"""Reduce-scatters a backward keeps outstanding (see ``_launch``): one communicating while the next group's
gradients are computed and filled in. Each holds its group's flat gradient (stage 3: a unit) until waited for;
one is enough to hide the reduction behind the next group's backward, and a second would add a unit of memory."""

# What a stage-1 view holds for its parameter (``ShardGradReducer._state``).
EMPTY, LOCAL, AVERAGED = 0, 1, 2
"""EMPTY: nothing (the value is ``param.grad``, or zero); LOCAL: this rank's accumulated gradient (``param.grad``
is the view); AVERAGED: the rank-average of the part inside the shard slice, zeros outside it."""


def attach_full_grads(group: FlatGroup, buffer: torch.Tensor) -> None:
    """Point every ``param.grad`` at its view of ``buffer`` (autograd then accumulates in place); a gradient
    that was replaced (``model.zero_grad()``) is copied back in first. (The pipeline's dp buckets use it.)"""
    with torch.no_grad():
        for p, view in zip(group.params, group.views(buffer)):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view


class ShardGradReducer:
    """Reduce-scatter of each group's gradients during backward (see module docstring). ``groups`` are in
    launch order. ``full_grads[k]`` (stage 1): group k's persistent flat gradient buffer; ``None`` for
    stages 2-3. ``algorithm``: the reduce-scatter implementation (``comm.reduce_scatter``). ``on_launched(k)``
    runs after group k's reduction started, or under ``no_sync`` once its gradients are all accumulated
    (stage 3 frees the unit's parameters there); ``on_backward_end()`` after the final wait. Collective
    hooks: every rank of the axis runs the same forward/backward sequence (same ``no_sync`` pattern)."""

    def __init__(self, groups: list[FlatGroup], mesh: Mesh, axis: str, *, reduce_dtype: torch.dtype,
                 algorithm: str = "native", overlap: bool = True, full_grads: list[torch.Tensor] | None = None,
                 on_launched: Callable[[int], None] | None = None,
                 on_backward_end: Callable[[], None] | None = None,
                 on_stored: Callable[[int], None] | None = None) -> None:
        self.groups = groups
        self.mesh, self.axis, self.reduce_dtype, self.overlap = mesh, axis, reduce_dtype, overlap
        self.algorithm = algorithm
        self.on_launched, self.on_backward_end = on_launched, on_backward_end
        self.on_stored = on_stored  # after group k's averaged shard is stored (offload copies it to the host)
        self.full = full_grads
        self._views = [g.views(b) for g, b in zip(groups, full_grads)] if full_grads is not None else []
        # Stage 1 writes the averaged shard into the buffer's slice when the dtypes allow it.
        self._in_slice = [b.dtype == reduce_dtype for b in full_grads] if full_grads is not None else []
        self._state = [[EMPTY] * len(g.params) for g in groups]
        # Shard buffers (hi - lo,) wherever the shard does not live in a full buffer's slice ("apart"): allocated
        # by the first reduction after a step and released by ``clear`` (the step consumed them), so between steps
        # and through the forward no gradient memory is held, and in backward the shards grow as the activations
        # are freed instead of on top of them (FSDP2's sharded gradients, set to None by zero_grad, likewise).
        self._apart = [not (full_grads is not None and self._in_slice[k]) for k in range(len(groups))]
        self._shards: list[torch.Tensor | None] = [None] * len(groups)
        self._reduced = [False] * len(groups)  # group reduced since the last clear()
        # Stages 2-3: group k's (L,) flat gradient of the running backward, filled parameter by parameter as each
        # gradient is ready (that ``param.grad`` is dropped at once), so a group's gradient exists about once
        # while it is produced, not as its ``param.grad`` s plus a flat copy made at launch.
        self._flat: list[torch.Tensor | None] = [None] * len(groups)
        self.sync = True
        """Whether the current backward reduces (set at forward time from ``no_sync``)."""
        self.unreduced = False
        """Local gradients were accumulated under ``no_sync`` and not reduced yet."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(k, j))
                       for k, g in enumerate(groups) for j, p in enumerate(g.params)]
        self.peak_in_flight = 0
        """The most reduce-scatters outstanding at once so far (at most ``MAX_IN_FLIGHT``)."""
        self._reset()

    @property
    def keeps_full(self) -> bool:
        """Stage 1: persistent full gradient buffers."""
        return self.full is not None

    def _reset(self) -> None:
        self.ready = [[False] * len(g.params) for g in self.groups]
        self.pending = [len(g.params) for g in self.groups]
        self.next_launch = 0
        self.handles: list[tuple[int, comm.Handle]] = []
        self.callback_queued = False
        self._flat = [None] * len(self.groups)  # a backward that raised leaves no half-filled flat gradient

    def prepare_forward(self, sync: bool) -> None:
        """Called at each forward with grad enabled: records the ``no_sync`` state for its backward and
        drops the half-done state of a backward that raised."""
        if self.callback_queued:
            self._reset()
        self.sync = sync

    # -- backward ---------------------------------------------------------------------------------------
    def _hook_for(self, k: int, j: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_ready(k, j)
        return hook

    def _on_ready(self, k: int, j: int) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        if self.full is not None:
            self._adopt(k, j)
        if self.ready[k][j]:
            if self.sync and k < self.next_launch:
                raise RuntimeError(f"ZeRO: parameter {self.groups[k].names[j]!r} received a second gradient in "
                                   f"one backward after its group's reduce-scatter started (reentrant activation "
                                   f"checkpointing?); use non-reentrant checkpointing (sw.checkpoint_layers, or "
                                   f"torch.utils.checkpoint(..., use_reentrant=False))")
            return
        self.ready[k][j] = True
        self.pending[k] -= 1
        if self.sync and self.full is None:
            self._absorb(k, j)
        if not self.sync:
            # Nothing to reduce, but the group's backward is over: stage 3 may free its parameters.
            self.unreduced = True
            if self.pending[k] == 0 and self.on_launched is not None:
                self.on_launched(k)
            return
        if self.overlap:
            while self.next_launch < len(self.groups) and self.pending[self.next_launch] == 0:
                self._launch(self.next_launch)

    @torch.no_grad()
    def _absorb(self, k: int, j: int) -> None:
        """Stages 2-3, a synchronised backward: copy ``params[j].grad`` (this backward's, plus what ``no_sync``
        backwards accumulated) into group k's flat gradient and drop it."""
        group = self.groups[k]
        flat = self._flat[k]
        if flat is None:  # (L,) every element written once: by a gradient here or zeroed at launch
            flat = self._flat[k] = torch.empty(group.layout.total, dtype=self.reduce_dtype, device=self.mesh.device)
        p, off, n = group.params[j], group.layout.offsets[j], group.layout.numels[j]
        if p.grad is not None:
            flat[off:off + n].copy_(p.grad.reshape(-1))
            p.grad = None
        else:
            flat[off:off + n].zero_()

    def _take_flat(self, k: int) -> torch.Tensor:
        """Group k's flat gradient for its reduction: what ``_absorb`` filled, with zeros where a parameter got
        no gradient in this backward (unused, or accumulated only under ``no_sync``: then its ``param.grad``)."""
        group = self.groups[k]
        for j in range(len(group.params)):
            if not self.ready[k][j]:
                self._absorb(k, j)
        flat, self._flat[k] = self._flat[k], None
        assert flat is not None
        return flat

    @torch.no_grad()
    def _adopt(self, k: int, j: int) -> None:
        """Stage 1: make ``params[j].grad`` the view holding this rank's accumulated gradient (one copy when
        autograd made a new tensor; an averaged slice turns back into its share of the sum, ``N *``)."""
        p, view = self.groups[k].params[j], self._views[k][j]
        g = p.grad
        if g is not None and g.data_ptr() == view.data_ptr():
            return  # autograd accumulated into the view in place
        state = self._state[k][j]
        if state == EMPTY:
            view.copy_(g) if g is not None else view.zero_()
        else:
            if state == AVERAGED:
                view.mul_(self.mesh.size(self.axis))
            if g is not None:
                view.add_(g)
        p.grad = view
        self._state[k][j] = LOCAL

    @torch.no_grad()
    def _launch(self, k: int) -> None:
        group = self.groups[k]
        if self.full is not None:
            for j in range(len(group.params)):
                self._adopt(k, j)  # unused parameters: zeros (or what earlier backwards accumulated)
            buf = self.full[k]
            flat = buf if buf.dtype == self.reduce_dtype else buf.to(self.reduce_dtype)
        else:
            # (L,) full gradient of the group, zeros where unused; each param.grad was dropped once copied (stage
            # 2's point: no full-size gradient survives its reduction)
            flat = self._take_flat(k)
        # The flat gradient is ours (stages 2-3, or stage 1's cast) or stage 1's full buffer, whose part outside
        # this rank's slice is not read again as gradients (``_store`` marks those parameters EMPTY): either way
        # the reduction may work in it, without a bucket-sized copy.
        handle = comm.reduce_scatter(flat, self.mesh, self.axis, op="avg", algorithm=self.algorithm,
                                     async_op=True, scratch=True)
        assert isinstance(handle, comm.Handle)
        self.handles.append((k, handle))
        # Bound the reductions in flight: each holds its group's full flat gradient (stage 3: a unit) until it
        # is waited for, so waiting only when backward ends would hold every unit's at once — the whole model's
        # gradient, which need not fit. The oldest is done or nearly (launched a group's backward ago).
        while len(self.handles) > MAX_IN_FLIGHT:
            k0, h0 = self.handles.pop(0)
            self._store(k0, h0.wait())
        self.peak_in_flight = max(self.peak_in_flight, len(self.handles))
        self.next_launch = k + 1
        if self.on_launched is not None:
            self.on_launched(k)

    @torch.no_grad()
    def _finish(self) -> None:
        try:
            if self.sync:
                while self.next_launch < len(self.groups):
                    self._launch(self.next_launch)
                for k, handle in self.handles:
                    self._store(k, handle.wait())
                self.unreduced = False
            if self.on_backward_end is not None:
                self.on_backward_end()
        finally:
            self._reset()

    def _store(self, k: int, shard: torch.Tensor) -> None:
        """Keep group k's averaged shard ``(hi - lo,)`` (see the module docstring for each stage)."""
        g = self.groups[k]
        first, self._reduced[k] = not self._reduced[k], True
        held = self._shards[k]
        if self._apart[k]:
            # Stages 2-3 add each backward's average (the first one after a step is copied into a new buffer:
            # ``shard`` may be a view of the whole flat gradient, which must not stay alive); stage 1 kept apart
            # replaces it (its full buffer holds the whole local sum).
            if held is None:
                held = self._shards[k] = torch.empty(g.hi - g.lo, dtype=self.reduce_dtype, device=shard.device)
            held.copy_(shard) if first or self.full is not None else held.add_(shard)
        else:
            buf = self.full[k]
            buf[g.lo:g.hi].copy_(shard)
            for j, (p, off, n) in enumerate(zip(g.params, g.layout.offsets, g.layout.numels)):
                p.grad = None
                inside = off < g.hi and off + n > g.lo
                self._state[k][j] = AVERAGED if inside else EMPTY
                if inside:  # a parameter across the slice's edge: its part outside holds no average
                    buf[off:max(off, g.lo)].zero_()
                    buf[min(off + n, g.hi):off + n].zero_()
        if self.on_stored is not None:
            self.on_stored(k)

    # -- what the optimizer reads -----------------------------------------------------------------------
    def shard(self, k: int) -> torch.Tensor:
        """Group k's averaged gradient shard ``(hi - lo,)`` in the reduce dtype (zeros when nothing was
        reduced since the last ``clear``). Local."""
        g = self.groups[k]
        held = self._shards[k]
        if not self._apart[k]:  # stage 1, in the full buffer's slice
            return self.full[k][g.lo:g.hi] if self._reduced[k] else self.full[k].new_zeros(g.hi - g.lo)  # type: ignore[index]
        if held is None or not self._reduced[k]:  # nothing reduced since the last clear: zeros (a new tensor)
            return torch.zeros(g.hi - g.lo, dtype=self.reduce_dtype, device=self.mesh.device)
        return held

    def held_shards(self) -> list[torch.Tensor]:
        """The shard buffers apart from the full buffers that exist now (for memory reports). Local."""
        return [s for s in self._shards if s is not None]

    @torch.no_grad()
    def clear(self) -> None:
        """Forget every gradient (a step consumed them, or ``zero_grad``): ``param.grad = None``, the shard buffers
        apart are released and nothing is zeroed — the next backward overwrites the full buffers. Local."""
        for k, g in enumerate(self.groups):
            for p in g.params:
                p.grad = None
            self._state[k] = [EMPTY] * len(g.params)
        self._shards = [None] * len(self.groups)  # released: the next backward allocates what it reduces
        self._reduced = [False] * len(self.groups)
        self.unreduced = False
