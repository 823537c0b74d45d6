"""Prompt exits for a local job: SIGKILL the ranks that outlive a failure (the launcher side), and make every rank
die with its launcher (the rank side, ``bind_to_launcher`` in ``launch.py``).

Why: torchrun stops a failed job with SIGTERM and waits 30 s before SIGKILL. A rank that is stopped (SIGSTOP,
a debugger, a stuck driver call in uninterruptible sleep) or ignores SIGTERM then holds the job ~30 s longer
than the collective timeout that detected it. ``RankSupervisor`` watches the launcher's own child processes
(the local ranks; Linux ``/proc``) and, once any of them has ended without finishing (no summary file of its
own: it raised, was killed or crashed), gives the rest ``grace_s`` seconds to end too before killing each
one's process group with SIGKILL. Used by ``shardwise train``, whose ranks write ``RUN/ranks/rankNNNNN.json``
when they finish; scripts under ``shardwise run`` are not supervised (rank 0 may work on after its peers).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RankSupervisor", "child_processes"]

_PROC = Path("/proc")


@dataclass
class _Child:
    pid: int
    rank: int | None
    zombie: bool


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # "pid (comm) state ppid ..." — comm may hold spaces or parentheses: split after the last ')'
    return text[text.rindex(")") + 2:].split()


def _rank_of(pid: int) -> int | None:
    try:
        env = (_PROC / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in env:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def child_processes(parent: int) -> dict[int, _Child]:
    """The direct children of ``parent`` (pid → child), zombies included; empty where ``/proc`` is absent."""
    out: dict[int, _Child] = {}
    for pid in _candidates(parent):
        fields = _stat_fields(pid)
        if fields is None or len(fields) < 2 or int(fields[1]) != parent:
            continue
        out[pid] = _Child(pid, _rank_of(pid), fields[0] == "Z")
    return out


def _candidates(parent: int) -> list[int]:
    """Pids that may be children of ``parent``: the kernel's per-thread child lists where it keeps them (cheap),
    else every process (a scan of ``/proc``)."""
    tasks = _PROC / str(parent) / "task"
    try:
        lists = [t / "children" for t in tasks.iterdir()]
        if lists and all(f.is_file() for f in lists):
            return [int(pid) for f in lists for pid in f.read_text().split()]
        return [int(e.name) for e in _PROC.iterdir() if e.name.isdigit()]
    except (OSError, ValueError):
        return []


@dataclass
class RankSupervisor:
    """Kill the local ranks that are still alive ``grace_s`` after the first one ended without finishing (see
    module docstring; a rank that wrote its summary file into ``marker_dir`` finished).

    Use as a context manager around the launch. ``killed`` lists the ranks it had to kill; with ``marker_dir``
    each gets a ``rankNNNNN.killed`` file there (the launcher's failure report names them)."""

    grace_s: float = 5.0
    poll_s: float = 0.2
    marker_dir: Path | None = None
    killed: list[int] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> "RankSupervisor":
        self._thread = threading.Thread(target=self._watch, name="shardwise-rank-supervisor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        me, seen, first_end = os.getpid(), {}, None  # seen: pid -> rank of every child observed alive
        while not self._stop.wait(self.poll_s):
            kids = child_processes(me)
            for pid, child in kids.items():
                if not child.zombie:
                    seen.setdefault(pid, child.rank)
            ended = [pid for pid in seen if (pid not in kids or kids[pid].zombie) and not self._finished(seen[pid])]
            if ended and first_end is None:
                first_end = time.monotonic()
            if first_end is not None and time.monotonic() - first_end >= self.grace_s:
                self._kill([kids[pid] for pid in seen if pid in kids and not kids[pid].zombie])
                first_end = time.monotonic()  # a later straggler (should not happen) gets the same grace

    def _finished(self, rank: int | None) -> bool:
        """Whether an ended rank ended well: it left its ``rankNNNNN.json`` summary in ``marker_dir`` (the trainer
        writes it just before its final barrier). Such an exit starts no countdown, so the peers' normal exit
        is never cut short however loaded the machine is."""
        if self.marker_dir is None or rank is None:
            return False
        return (self.marker_dir / f"rank{rank:05d}.json").is_file()

    def _kill(self, alive: list[_Child]) -> None:
        for child in alive:
            try:  # torchrun starts each rank in its own session: its process group is its pid
                os.killpg(child.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
            rank = child.rank if child.rank is not None else -1
            self.killed.append(rank)
            if self.marker_dir is not None and rank >= 0:
                self.marker_dir.mkdir(parents=True, exist_ok=True)
                (self.marker_dir / f"rank{rank:05d}.killed").write_text(
                    f"rank {rank} was still running {self.grace_s:g} s after another rank ended; killed with SIGKILL "
                    f"(hung, stopped or ignoring SIGTERM)\n")
