"""Gradient reduction for ZeRO: full gradients (``P`` over the axis) become averaged shards (``S(0)``).

Stage 1 keeps full gradients in one persistent flat buffer per group (``param.grad`` are views of it) and
reduce-scatters them once, lazily, when the optimizer needs them (``clip_grad_norm_`` or ``step``), as
DeepSpeed's stage 1 does at the accumulation boundary: backward never communicates.

Stages 2-3 reduce *during* backward (``ShardGradReducer``): every parameter has a post-accumulate-grad
hook; when all parameters of a group (a bucket, or a stage-3 unit) hold their gradient, the group's
gradients are flattened, the full ``param.grad`` are dropped, and an asynchronous averaging
reduce-scatter starts while backward goes on with earlier layers. Groups are launched strictly in launch
order so that every rank issues the same collectives in the same sequence; a callback queued on the
autograd engine launches what is left (groups with unused parameters contribute zeros), waits, and adds
the results into the persistent shard-gradient buffers before ``backward()`` returns. Repeated backwards
without a step therefore accumulate, as in plain PyTorch.

``no_sync``: backwards of forwards run inside it keep full gradients locally (no communication, full
gradient memory); the next synchronised backward reduces the accumulated sum. Stepping while local
gradients are unreduced raises instead of silently dropping them.
"""

from __future__ import annotations

from typing import Callable

import torch

from ... import comm
from ...mesh import Mesh
from .flat import FlatGroup

__all__ = ["ShardGradReducer", "reduce_full_grads", "attach_full_grads"]


def attach_full_grads(group: FlatGroup, buffer: torch.Tensor) -> None:
    """Stage 1: point every ``param.grad`` at its view of ``buffer`` (autograd then accumulates in place);
    a gradient that was replaced (``model.zero_grad()``) is copied back in first."""
    with torch.no_grad():
        for p, view in zip(group.params, group.views(buffer)):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view


def reduce_full_grads(groups: list[FlatGroup], buffers: list[torch.Tensor], mesh: Mesh, axis: str,
                      reduce_dtype: torch.dtype) -> list[torch.Tensor]:
    """Stage 1: average each group's full flat gradient buffer over the axis and return this rank's shard
    of each (reduce-scatter, one per group, all started before the first wait). Collective."""
    handles = []
    for g, buf in zip(groups, buffers):
        attach_full_grads(g, buf)
        src = buf if buf.dtype == reduce_dtype else buf.to(reduce_dtype)
        handles.append(comm.reduce_scatter(src, mesh, axis, op="avg", async_op=True))
    return [h.wait() for h in handles]  # type: ignore[union-attr]


class ShardGradReducer:
    """Stages 2-3 (see module docstring). ``groups`` are in launch order; ``shard_grads[k]`` is group k's
    persistent shard-gradient buffer. ``on_launched(k)`` runs after group k's gradients are flattened, or
    under ``no_sync`` once they are all accumulated (stage 3 frees the unit's parameters there);
    ``on_backward_end()`` after the final wait."""

    def __init__(self, groups: list[FlatGroup], shard_grads: list[torch.Tensor], mesh: Mesh, axis: str, *,
                 reduce_dtype: torch.dtype, overlap: bool = True,
                 on_launched: Callable[[int], None] | None = None,
                 on_backward_end: Callable[[], None] | None = None) -> None:
        self.groups, self.shard_grads = groups, shard_grads
        self.mesh, self.axis, self.reduce_dtype, self.overlap = mesh, axis, reduce_dtype, overlap
        self.on_launched, self.on_backward_end = on_launched, on_backward_end
        self.sync = True
        """Whether the current backward reduces (set at forward time from ``no_sync``)."""
        self.unreduced = False
        """Local gradients were accumulated under ``no_sync`` and not reduced yet."""
        self._handles_hooks = []
        for k, g in enumerate(groups):
            for p in g.params:
                self._handles_hooks.append(p.register_post_accumulate_grad_hook(self._hook_for(k)))
        self._reset()

    def _reset(self) -> None:
        self.ready = [0] * len(self.groups)
        self.next_launch = 0
        self.pending: list[tuple[int, comm.Handle]] = []
        self.callback_queued = False

    def prepare_forward(self, sync: bool) -> None:
        """Called at each forward with grad enabled: records the ``no_sync`` state for its backward and
        drops the half-done state of a backward that raised."""
        if self.callback_queued:
            self._reset()
        self.sync = sync

    def _hook_for(self, k: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            if not self.callback_queued:
                self.callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.ready[k] += 1
            if not self.sync:
                # Nothing to reduce, but the group's backward is over: stage 3 may free its parameters.
                self.unreduced = True
                if self.ready[k] == len(self.groups[k].params) and self.on_launched is not None:
                    self.on_launched(k)
                return
            if self.overlap:
                self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.groups) and \
                self.ready[self.next_launch] >= len(self.groups[self.next_launch].params):
            self._launch(self.next_launch)

    @torch.no_grad()
    def _launch(self, k: int) -> None:
        group = self.groups[k]
        flat = group.flat_grads(self.reduce_dtype)  # (L,) full gradient of the group, zeros where unused
        for p in group.params:
            p.grad = None  # stage 2's point: no full-size gradient survives its reduction
        handle = comm.reduce_scatter(flat, self.mesh, self.axis, op="avg", async_op=True)
        assert isinstance(handle, comm.Handle)
        self.pending.append((k, handle))
        self.next_launch = k + 1
        if self.on_launched is not None:
            self.on_launched(k)

    @torch.no_grad()
    def _finish(self) -> None:
        try:
            if self.sync:
                while self.next_launch < len(self.groups):
                    self._launch(self.next_launch)
                for k, handle in self.pending:
                    self.shard_grads[k].add_(handle.wait())
                self.unreduced = False
            if self.on_backward_end is not None:
                self.on_backward_end()
        finally:
            self._reset()
