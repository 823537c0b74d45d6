"""Asynchronous handles for collectives.

Native collectives return the backend's ``Work``. Our point-to-point algorithms (ring, tree) run on one
worker thread per (mesh, axis): a single thread keeps every rank's sequence of algorithm calls in the same
order, which point-to-point matching relies on, while the caller's thread goes on computing (this is how
``DataParallel`` overlaps a ring all-reduce with backward). The wait releases the GIL inside gloo.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from ..world import on_teardown

__all__ = ["Handle", "worker_for"]


class Handle:
    """Result of an ``async_op=True`` collective. ``wait()`` blocks until done and returns the result tensor."""

    def __init__(self, *, work: dist.Work | None = None, future: "Future[torch.Tensor] | None" = None,
                 finish: Callable[[], torch.Tensor] | None = None) -> None:
        self._work, self._future, self._finish = work, future, finish
        self._result: torch.Tensor | None = None
        self._done = False

    def wait(self) -> torch.Tensor:
        if not self._done:
            if self._work is not None:
                self._work.wait()
            if self._future is not None:
                self._result = self._future.result()
            if self._finish is not None:
                self._result = self._finish()
            self._done = True
        assert self._result is not None
        return self._result

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._work is not None:
            return bool(self._work.is_completed())
        if self._future is not None:
            return self._future.done()
        return True


_LOCK = threading.Lock()


def worker_for(owner: object, axis: str) -> ThreadPoolExecutor:
    """The single worker thread serving ``owner``'s (a ``Mesh``) axis; created on first use."""
    with _LOCK:
        workers: dict[str, ThreadPoolExecutor] = owner.__dict__.setdefault("_comm_workers", {})
        if axis not in workers:
            device = getattr(owner, "device", torch.device("cpu"))
            # The current CUDA device is per thread: the worker must use the rank's device, not cuda:0.
            init, args = (torch.cuda.set_device, (device,)) if device.type == "cuda" else (None, ())
            workers[axis] = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shardwise-comm-{axis}",
                                               initializer=init, initargs=args)
            # sw.shutdown() / the exit hook: queued ring and tree calls finish before the process groups go
            on_teardown(partial(workers[axis].shutdown, wait=True))
        return workers[axis]
