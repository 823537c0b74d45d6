"""The encoding processes of ``shardwise prepare``: fresh interpreters that run ``encode_worker.py`` as a file.

Why not ``multiprocessing``: its spawn and forkserver children import the parent's ``__main__`` and, to unpickle
the worker function, the ``shardwise`` package — torch included, about a second per process before the first
token — and a script that calls ``prepare`` without an ``if __name__ == "__main__":`` guard would start itself
again. Fork is no option either (a forked child inherits tokenizers' and torch's thread locks half-held). These
workers import numpy and tokenizers only, and talk over their stdin/stdout (``encode_worker.serve``).

Chunk ``k`` goes to worker ``k mod N`` and results are taken in submission order, so the writer sees the chunks
in input order. A worker reads its input on a separate thread, so a parent writing a chunk never waits for a
worker that is itself waiting to hand back a result. When the parent dies, the workers' stdin ends and they exit.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from .encode_worker import Chunk, ChunkResult, WorkerConfig, read_message, result_from_fields, send_message

__all__ = ["WorkerPool", "Pending"]

_BOOT = ("import importlib.util as u, sys; s = u.spec_from_file_location('_shardwise_prepare_worker', sys.argv[1]); "
         "m = u.module_from_spec(s); sys.modules[s.name] = m; s.loader.exec_module(m); m.serve()")
"""Load ``encode_worker.py`` by its path under a name of its own (no package import, no directory on sys.path)."""


def _fields(obj: object) -> tuple[object, ...]:
    """A dataclass's field values, shallow (``dataclasses.astuple`` would deep-copy a chunk's payload)."""
    return tuple(getattr(obj, f.name) for f in dataclasses.fields(obj))  # type: ignore[arg-type]


class Pending:
    """A submitted chunk; ``result()`` waits for its worker's reply (call them in submission order)."""

    def __init__(self, pool: WorkerPool, worker: int) -> None:
        self.pool, self.worker = pool, worker

    def result(self) -> ChunkResult:
        proc = self.pool.procs[self.worker]
        try:
            reply = read_message(proc.stdout)  # type: ignore[arg-type]
        except EOFError:
            code = proc.wait()
            raise RuntimeError(f"encoding worker {self.worker} (pid {proc.pid}) exited with code {code} before "
                               f"returning its chunk; its error output is above") from None
        if reply[0] == "ok":
            return result_from_fields(reply[1])
        if reply[1] == "ValueError":
            raise ValueError(reply[2])
        raise RuntimeError(f"encoding worker {self.worker} failed:\n{reply[2]}")


class WorkerPool:
    """``n`` worker processes with ``config`` loaded; ``submit(chunk)`` → ``Pending``. A context manager: on exit
    the workers' inputs are closed and they are waited for (killed when the exit is due to an exception)."""

    def __init__(self, n: int, config: WorkerConfig) -> None:
        script = str(Path(__file__).with_name("encode_worker.py"))
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        self.procs: list[subprocess.Popen] = []
        self.submitted = 0
        for _ in range(n):
            self.procs.append(subprocess.Popen([sys.executable, "-c", _BOOT, script], stdin=subprocess.PIPE,
                                               stdout=subprocess.PIPE, env=env))
        for p in self.procs:
            send_message(p.stdin, _fields(config))  # type: ignore[arg-type]

    def submit(self, chunk: Chunk) -> Pending:
        worker = self.submitted % len(self.procs)
        self.submitted += 1
        send_message(self.procs[worker].stdin, _fields(chunk))  # type: ignore[arg-type]
        return Pending(self, worker)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        for p in self.procs:
            if exc_type is not None:
                p.kill()
            try:
                p.stdin.close()  # type: ignore[union-attr]
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()  # type: ignore[union-attr]
