"""The gradient reducer behind ``DataParallel(average="gradients")``: buckets at run time, overlap, stats.

Each trainable parameter gets a post-accumulate-grad hook. When the last gradient of a bucket has been
accumulated, the bucket's averaging all-reduce starts asynchronously (overlap) while backward goes on with
earlier layers. Buckets are launched strictly in plan order, so every rank issues the same collectives in
the same sequence even when gradients become ready in a different order. A callback queued on the autograd
engine runs when backward ends: it launches what is left, waits for everything, and only then does
``backward()`` return — no optimizer can read an unreduced gradient.

Gradients are views into the flat bucket buffers (``param.grad`` aliases bucket storage), so the all-reduce
result needs no copy back. If ``param.grad`` was reset to ``None`` (``zero_grad()``'s default), autograd
allocates a fresh gradient and the hook copies it into the bucket once and re-points ``param.grad``.
``grad_views=False`` keeps separate gradients and copies in and out of the buckets instead.

The last bucket ends with a status tail, one element per parameter: 1.0 where this rank produced no
gradient since the last synchronisation. It is averaged with the gradients, so every rank learns which
parameters were unused anywhere without an extra collective — and raises the same error instead of hanging.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ... import comm
from ...mesh import Mesh
from ..common.buckets import BucketPlan, default_order, observed_order, plan_buckets
from .comm_hooks import Bucket, CommHook, Waitable, allreduce_hook
from .comm_stats import CommStats, StepTimer

__all__ = ["GradientReducer"]


def _graph_task_id() -> int:
    """Id of the autograd graph task running this hook (-1 where torch does not expose it)."""
    probe = getattr(torch._C, "_current_graph_task_id", None)
    return int(probe()) if probe is not None else -1


class GradientReducer:
    """Runs a ``BucketPlan`` for one set of parameters (see module docstring). Collective hooks: every rank
    of the axis must run the same forward/backward sequence (same ``no_sync`` pattern)."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], mesh: Mesh, axis: str, *, cap_bytes: int,
                 first_cap_bytes: int, overlap: bool, algorithm: str, find_unused: bool,
                 grad_views: bool = True) -> None:
        self.names = [n for n, _ in params]
        self.params = [p for _, p in params]
        self.mesh, self.axis, self.algorithm = mesh, axis, algorithm
        self.overlap, self.find_unused, self.grad_views = overlap, find_unused, grad_views
        self.cap_bytes, self.first_cap_bytes = cap_bytes, first_cap_bytes
        self.hook: CommHook = allreduce_hook
        self.sync = True
        """Whether the current backward reduces (set from ``no_sync`` at forward time)."""
        self.stats = StepTimer()
        self._order_seen: list[int] | None = []  # ready order of the first backward; None once rebuilt
        self._rebuild_due = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]
        self._install(plan_buckets(self._nbytes(), self._keys(), cap_bytes=cap_bytes,
                                   first_cap_bytes=first_cap_bytes, order=default_order(len(self.params))))

    # -- plan and storage -----------------------------------------------------------------------------
    def _nbytes(self) -> list[int]:
        return [p.numel() * p.element_size() for p in self.params]

    def _keys(self) -> list[tuple[torch.dtype, torch.device]]:
        return [(p.dtype, p.device) for p in self.params]

    @torch.no_grad()
    def _install(self, plan: BucketPlan) -> None:
        """Allocate one flat buffer per bucket and move existing gradients into their views."""
        self.plan = plan
        n = len(self.params)
        self.buffers: list[torch.Tensor] = []
        self.offsets: list[list[int]] = []
        self.views: list[torch.Tensor] = [torch.empty(0)] * n
        self.where: list[int] = [0] * n
        for b, members in enumerate(plan.buckets):
            first = self.params[members[0]]
            sizes = [self.params[i].numel() for i in members]
            tail = n if b == len(plan) - 1 else 0  # status tail: one flag per parameter
            buf = torch.zeros(sum(sizes) + tail, dtype=first.dtype, device=first.device)
            offs = [sum(sizes[:k]) for k in range(len(sizes))]
            for i, off, size in zip(members, offs, sizes):
                self.views[i] = buf[off:off + size].view(self.params[i].shape)
                self.where[i] = b
                g = self.params[i].grad
                if g is not None and self.grad_views:
                    self.views[i].copy_(g)
                    self.params[i].grad = self.views[i]
            self.buffers.append(buf)
            self.offsets.append(offs)
        self._reset_iteration()

    def _reset_iteration(self) -> None:
        self.ready = [False] * len(self.params)
        self.used = [False] * len(self.params)  # produced a gradient since the last synchronisation
        self.had_grad = [True] * len(self.params)
        self.pending = [len(m) for m in self.plan.buckets]
        self.next_launch = 0
        self.futures: list[Waitable | None] = [None] * len(self.plan)
        self.callback_queued = False
        self.task = -1  # autograd graph task of the current backward

    def prepare_forward(self, sync: bool) -> None:
        """Called at the start of each forward of the wrapper. After the first backward, every rank adopts
        coordinate 0's observed ready order (one broadcast, once) and rebuilds its buckets in that order.
        Collective when the rebuild is due."""
        self.sync = sync
        if self.callback_queued:
            # The previous backward raised before it ended: drop its half-done state so that this
            # iteration's callback is queued again (the failed step's gradients are not reduced).
            self._reset_iteration()
        if self._rebuild_due:
            order = torch.tensor(observed_order(self._order_seen or [], len(self.params)), dtype=torch.int64,
                                 device=self.mesh.device)
            comm.broadcast(order, self.mesh, self.axis, src=0)
            self._rebuild_due, self._order_seen = False, None
            self._install(plan_buckets(self._nbytes(), self._keys(), cap_bytes=self.cap_bytes,
                                       first_cap_bytes=self.first_cap_bytes, order=order.cpu().tolist()))

    # -- backward -------------------------------------------------------------------------------------
    def _hook_for(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._on_ready(i)
        return hook

    def _on_ready(self, i: int) -> None:
        task = _graph_task_id()
        if not self.callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self.callback_queued, self.task = True, task
            if self.sync:
                self.stats.start_backward()
        elif task != self.task:
            # A nested backward (reentrant checkpointing) would end — and run our callback — before the
            # outer one has produced the other gradients.
            raise RuntimeError(f"parameter {self.names[i]!r} received its gradient in a nested backward pass "
                               f"(reentrant activation checkpointing?); DataParallel needs every gradient of a "
                               f"step produced by one backward: use non-reentrant checkpointing "
                               f"(sw.checkpoint_layers, or torch.utils.checkpoint(..., use_reentrant=False))")
        if self._order_seen is not None:
            self._order_seen.append(i)
        self.used[i] = True
        self._adopt_grad(i)
        if not self.sync:
            return
        if self.ready[i]:
            if self.futures[self.where[i]] is not None:
                raise RuntimeError(f"parameter {self.names[i]!r} received a second gradient in one backward after "
                                   f"its bucket was already being reduced; produce each gradient once per "
                                   f"synchronised backward")
            return
        self.ready[i] = True
        self.pending[self.where[i]] -= 1
        if self.overlap:
            self._launch_ready()
        self.stats.poll(self.futures)

    @torch.no_grad()
    def _adopt_grad(self, i: int) -> None:
        """Make ``params[i].grad`` alias its bucket view (views mode): one copy when autograd made a new one."""
        if not self.grad_views:
            return
        p, view = self.params[i], self.views[i]
        g = p.grad
        if g is None:
            view.zero_()
            self.had_grad[i] = False
        elif g.data_ptr() != view.data_ptr():
            view.copy_(g)
        p.grad = view

    def _launch_ready(self) -> None:
        while self.next_launch < len(self.plan) and self.pending[self.next_launch] == 0:
            self._launch(self.next_launch)
            self.next_launch += 1

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        members = self.plan.buckets[b]
        buf = self.buffers[b]
        if not self.grad_views:
            for i, off in zip(members, self.offsets[b]):
                g = self.params[i].grad
                dst = buf[off:off + self.params[i].numel()]
                dst.copy_(g.reshape(-1)) if g is not None else dst.zero_()
        if b == len(self.plan) - 1:  # (P,) status tail: 1.0 = no gradient on this rank since the last sync
            buf[-len(self.params):].copy_(torch.tensor([0.0 if u else 1.0 for u in self.used], dtype=buf.dtype))
        bucket = Bucket(index=b, buffer=buf, parameters=[self.params[i] for i in members],
                        offsets=list(self.offsets[b]), mesh=self.mesh, axis=self.axis, algorithm=self.algorithm)
        self.stats.launch(b)
        self.futures[b] = self.hook(bucket)

    def _on_backward_end(self) -> None:
        self.callback_queued = False
        if self._order_seen is not None and not self._rebuild_due:
            self._rebuild_due = True  # rebuild at the next forward, in the order seen here
        if not self.sync:
            return
        self.stats.enter_end()
        for i in range(len(self.params)):
            if not self.ready[i]:  # no gradient this backward: contributes what .grad holds (zero if None)
                self._adopt_grad(i)
                self.ready[i] = True
                self.pending[self.where[i]] -= 1
        self._launch_ready()
        results = self.stats.wait_all(self.futures)
        self._finish(results)

    @torch.no_grad()
    def _finish(self, results: list[torch.Tensor]) -> None:
        n = len(self.params)
        for b, out in enumerate(results):
            if out.data_ptr() != self.buffers[b].data_ptr():
                self.buffers[b].copy_(out)
        unused = self.buffers[-1][-n:].tolist()  # mean over ranks of "no gradient here"
        missing = [i for i in range(n) if unused[i] > 0.0]
        if missing and not self.find_unused:
            self._reset_iteration()
            self._raise_unused(missing, unused)
        size = self.mesh.size(self.axis)
        for i, p in enumerate(self.params):
            everywhere_unused = unused[i] > 1.0 - 0.5 / size
            if self.grad_views:
                p.grad = None if (everywhere_unused and not self.had_grad[i]) else self.views[i]
            elif not (everywhere_unused and p.grad is None):
                if p.grad is None:
                    p.grad = self.views[i].clone()
                else:
                    p.grad.copy_(self.views[i])
        self.stats.end_step(len(self.plan))
        self._reset_iteration()

    def _raise_unused(self, missing: list[int], unused: list[float]) -> None:
        size = self.mesh.size(self.axis)
        listed = ", ".join(f"{self.names[i]!r} (on {round(unused[i] * size)} of {size} ranks)" for i in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"{len(missing)} parameter(s) received no gradient in this backward on some ranks of axis "
                         f"{self.axis!r}: {listed}{more}. Every trainable parameter must take part in the loss, "
                         f"or pass find_unused_parameters=True (or set requires_grad=False on them)")

    def comm_stats(self, reset: bool = False) -> CommStats:
        return self.stats.summary(reset=reset)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
