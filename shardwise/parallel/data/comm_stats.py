"""How much gradient communication ``DataParallel`` hid behind backward: per-step timing of the buckets.

For every bucket we note when its all-reduce was launched and when it was first *seen* complete (polled at
every gradient hook, then at the end of backward, and after each wait returns). Reductions on one axis run
one after another, so the communication time of a step is the union of the intervals
``[launch, done]``; the *exposed* part is what backward's end spent blocked waiting, and the rest was hidden
behind computation. Completion is observed by polling, so ``comm_s`` is an upper bound (by at most one
hook interval per bucket). With CUDA, host timestamps measure the launch queue, not the kernels: read
these numbers on CPU ranks, or synchronise first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import torch

from .comm_hooks import Waitable

__all__ = ["CommStats", "StepTimer"]


@dataclass(frozen=True)
class CommStats:
    """Totals over ``steps`` synchronised backward passes (seconds)."""

    steps: int
    buckets: int
    """All-reduces issued (one per bucket per step)."""
    comm_s: float
    """Time at least one bucket reduction was in flight (upper bound, see module docstring)."""
    exposed_s: float
    """Time from the end of backward's computation until every reduction had finished (launching the
    buckets left, then waiting): the communication *not* hidden."""
    backward_s: float
    """From the first gradient hook to the end of the last wait."""

    @property
    def hidden_s(self) -> float:
        return max(0.0, self.comm_s - self.exposed_s)

    @property
    def hidden_share(self) -> float:
        """Fraction of the communication time overlapped with backward computation (0 when none ran)."""
        return self.hidden_s / self.comm_s if self.comm_s > 0 else 0.0

    def per_step(self) -> dict[str, float]:
        k = max(self.steps, 1)
        return {"buckets": self.buckets / k, "comm_ms": 1e3 * self.comm_s / k,
                "exposed_ms": 1e3 * self.exposed_s / k, "hidden_ms": 1e3 * self.hidden_s / k,
                "backward_ms": 1e3 * self.backward_s / k, "hidden_share": self.hidden_share}


def _done(fut: object) -> bool:
    probe = getattr(fut, "is_completed", None) or getattr(fut, "done", None)
    return bool(probe()) if probe is not None else False


class StepTimer:
    """Collects the bucket timestamps of the current step and the running totals."""

    def __init__(self) -> None:
        self._totals = [0, 0, 0.0, 0.0, 0.0]  # steps, buckets, comm, exposed, backward
        self._begin()

    def _begin(self) -> None:
        self._t0: float | None = None
        self._launched: dict[int, float] = {}
        self._finished: dict[int, float] = {}
        self._exposed = 0.0
        self._end_entered: float | None = None
        self._poll_from = 0

    def start_backward(self) -> None:
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def enter_end(self) -> None:
        """Backward's computation is over; from here on, time is spent on communication only."""
        self._end_entered = time.perf_counter()

    def launch(self, b: int) -> None:
        self._launched[b] = time.perf_counter()

    def poll(self, futures: Sequence[Waitable | None]) -> None:
        """Record completions of launched buckets (they finish in launch order, so stop at the first busy)."""
        while self._poll_from < len(futures) and futures[self._poll_from] is not None:
            if not _done(futures[self._poll_from]):
                return
            self._finished.setdefault(self._poll_from, time.perf_counter())
            self._poll_from += 1

    def wait_all(self, futures: Sequence[Waitable | None]) -> list[torch.Tensor]:
        """Wait for every bucket in order; everything since ``enter_end`` is the step's exposed communication."""
        self.poll(futures)
        out = []
        for b, fut in enumerate(futures):
            assert fut is not None, f"bucket {b} was never launched"
            out.append(fut.wait())
            self._finished.setdefault(b, time.perf_counter())
        now = time.perf_counter()
        self._exposed = now - (self._end_entered if self._end_entered is not None else now)
        return out

    def end_step(self, buckets: int) -> None:
        end = time.perf_counter()
        busy, last = 0.0, 0.0
        for b in sorted(self._launched):
            start = max(self._launched[b], last)
            last = max(self._finished.get(b, end), start)
            busy += last - start
        t = self._totals
        t[0] += 1
        t[1] += buckets
        t[2] += busy
        t[3] += self._exposed
        t[4] += end - (self._t0 if self._t0 is not None else end)
        self._begin()

    def summary(self, reset: bool = False) -> CommStats:
        s, b, c, e, bw = self._totals
        out = CommStats(steps=int(s), buckets=int(b), comm_s=c, exposed_s=e, backward_s=bw)
        if reset:
            self._totals = [0, 0, 0.0, 0.0, 0.0]
        return out
