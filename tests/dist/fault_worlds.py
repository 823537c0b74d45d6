"""A fresh spawned world in which one rank dies on purpose: the survivors' reports, or a failed test if they
hang. Shared by the shared-memory fault tests (collectives and point-to-point)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import tempfile
from typing import Any, Callable

import pytest


def survivors(target: Callable[..., Any], n: int, victim: int, what: str) -> list[tuple]:
    """Run ``target(rank, n, init_file, victim, results)`` on ``n`` spawned processes; return the ``n - 1``
    survivors' reports. The victim must exit with code 3. ``what`` names the transport in a hang message."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_file = os.path.join(tempfile.mkdtemp(prefix="shardwise-fault-"), "rendezvous")
    procs = [ctx.Process(target=target, args=(r, n, init_file, victim, results), daemon=True) for r in range(n)]
    for p in procs:
        p.start()
    try:
        # The group timeout is 600 s: answers well within 120 s come from the liveness check.
        got = [results.get(timeout=120) for _ in range(n - 1)]
    except queue.Empty:
        pytest.fail(f"survivors of a dead {what} peer did not report within 120 s (hang)")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert procs[victim].exitcode == 3
    return got


def report_and_exit(results: Any, row: tuple) -> None:
    """A surviving rank's last act: put its report, flush the queue's feeder thread, and leave without the
    process group's collective teardown (a peer is dead, so it would hang)."""
    results.put(row)
    results.close()
    results.join_thread()
    os._exit(0)
