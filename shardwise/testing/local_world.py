"""``LocalWorld``: a persistent world of N local CPU ranks for tests and benchmarks.

Spawning processes and importing torch costs seconds, so a world is started once and then runs many
functions: ``world.run(fn, *args)`` calls ``fn(*args)`` on every rank (``fn`` must be importable by name,
i.e. defined at module level) and returns the per-rank results. A run that exceeds its timeout, or in which
some rank raised, fails fast with every rank's traceback (stuck ranks are dumped with ``faulthandler``)
and the world is torn down; the next ``run`` starts a fresh one.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

__all__ = ["LocalWorld", "RankFailure"]


class RankFailure(AssertionError):
    """One or more ranks raised, or the run timed out; the message holds every rank's traceback."""


def _serve(rank: int, n: int, init_file: str, tasks: "mp.Queue[Any]", results: "mp.Queue[Any]",
           trace_path: str, collective_timeout_s: float) -> None:
    trace_file = open(trace_path, "w")
    faulthandler.register(signal.SIGUSR1, file=trace_file, all_threads=True)
    from ..world import init

    init(backend="gloo", init_method=f"file://{init_file}", rank=rank, world_size=n,
         timeout_s=collective_timeout_s)
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # report everything, including assertion errors, to the parent
            results.put((rank, False, traceback.format_exc()))
    # Every rank of the world is told to stop at once, so there is nothing to tear down with the peers; skipping
    # the interpreter's teardown (~0.8 s of a core per rank once torch.optim has imported torch._dynamo) makes
    # closing a world nearly free. Shared-memory segments are unlinked as soon as they are mapped: none is left.
    results.close()
    results.join_thread()  # the last result must reach the parent before the process vanishes
    trace_file.close()
    os._exit(0)


class LocalWorld:
    """``n`` spawned gloo ranks on this machine, reused across many ``run`` calls."""

    def __init__(self, n: int, *, collective_timeout_s: float = 60.0) -> None:
        if n < 1:
            raise ValueError(f"a world needs at least one rank, got {n}")
        self.n = n
        self.collective_timeout_s = collective_timeout_s
        self._procs: list[mp.Process] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix=f"shardwise-world{self.n}-")
        init_file = os.path.join(self._dir, "rendezvous")
        self._results: "mp.Queue[Any]" = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.n)]
        self._traces = [os.path.join(self._dir, f"trace-{r}.txt") for r in range(self.n)]
        self._procs = [ctx.Process(target=_serve, daemon=True, name=f"shardwise-rank{r}",
                                   args=(r, self.n, init_file, self._tasks[r], self._results, self._traces[r],
                                         self.collective_timeout_s)) for r in range(self.n)]
        for p in self._procs:
            p.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return results in rank order or raise ``RankFailure``."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            self.close()
            self._start()
        for q in self._tasks:
            q.put((fn, args, kwargs))
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < self.n:
            try:
                rank, ok, value = self._results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline or any(not p.is_alive() for p in self._procs):
                    self._fail(fn, errors, results, f"timed out after {timeout:.0f} s" if time.monotonic()
                               > deadline else "a rank process died")
                continue
            (results if ok else errors)[rank] = value
            if errors and time.monotonic() + 10 < deadline:
                deadline = time.monotonic() + 10  # peers of a failed rank are likely stuck: do not wait long
        if errors:
            self._fail(fn, errors, results, "raised")
        return [results[r] for r in range(self.n)]

    def _fail(self, fn: Callable[..., Any], errors: dict[int, str], results: dict[int, Any], why: str) -> None:
        stuck = [r for r in range(self.n) if r not in errors and r not in results]
        for r in stuck:
            pid = self._procs[r].pid
            if self._procs[r].is_alive() and pid is not None:
                os.kill(pid, signal.SIGUSR1)
        time.sleep(1.0 if stuck else 0)
        parts = [f"{getattr(fn, '__qualname__', fn)} on {self.n} ranks: {why}"]
        for r in sorted(errors):
            parts.append(f"--- rank {r} raised ---\n{errors[r]}")
        for r in stuck:
            trace = Path(self._traces[r]).read_text() if Path(self._traces[r]).exists() else ""
            state = "alive" if self._procs[r].is_alive() else f"exit code {self._procs[r].exitcode}"
            parts.append(f"--- rank {r} did not finish ({state}); its stacks ---\n{trace or '(none captured)'}")
        self.close()
        raise RankFailure("\n".join(parts))

    def stop(self) -> None:
        """Tell every rank to exit, without waiting (``close`` waits): closing several worlds, stop them all
        first so that they exit together."""
        for q, p in zip(getattr(self, "_tasks", []), self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass

    def close(self) -> None:
        """Stop every rank (politely, then by force)."""
        self.stop()
        for p in self._procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        self._procs = []

    def __enter__(self) -> "LocalWorld":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if sys.platform == "win32":  # pragma: no cover - SIGUSR1 does not exist there
    raise ImportError("LocalWorld needs a POSIX system (it dumps stuck ranks with SIGUSR1)")
