"""One writer per run directory: ``RUN/.lock`` is held while a command (``shardwise train``, ``shardwise verify``)
writes ``RUN/``, so that a second command into the same directory is refused before it does anything instead
of appending its metrics to the first one's, replacing its checkpoints or its ``config.json``.

The lock is a file and an ``fcntl.flock`` on it:

* it is published whole and atomically: written (pid, host, start time, command) and flocked under a private
  name created with ``O_CREAT | O_EXCL``, then ``os.link``-ed to ``RUN/.lock``, which fails if the name exists —
  so a reader never sees a half-written lock, and of two commands racing exactly one wins;
* the flock is the liveness test: the kernel drops it when its holder exits however it exits (an exception,
  Ctrl-C, SIGKILL, an OOM kill), so a lock whose flock can be taken on this host is stale, and is taken over
  with a one-line note. Where flock is not available (some network file systems), a lock of this host whose
  process is gone (pid, and its start time against pid reuse) is stale; a lock of another host is never
  taken over (its process cannot be checked from here): the error says to delete the file if it is gone.

The launcher takes it before any rank starts and releases it when the command ends (``with RunLock(...)``); a
restart within one job (``train.max_restarts``) keeps it. Ranks never touch it: the descriptor is not
inherited (Python opens files close-on-exec).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["LOCK_FILE", "RunLock", "RunLockedError", "read_lock"]

LOCK_FILE = ".lock"


class RunLockedError(ValueError):
    """Another live command holds the run directory's lock (a user error: one line, exit code 2)."""


def _proc_start(pid: int) -> str:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), '' where unknown: with
    the pid it names one process, never a later one that reused the pid."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = text[text.rindex(")") + 2:].split()
    return fields[19] if len(fields) > 19 else ""


def _alive(info: dict[str, Any]) -> bool:
    """Whether the holder named by ``info`` (a lock of this host) still runs."""
    pid = info.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    start = info.get("pid_start") or ""
    now = _proc_start(pid)
    return not (start and now and start != now)


def read_lock(path: Path) -> dict[str, Any]:
    """The holder recorded in a lock file ({} when it cannot be read)."""
    try:
        data = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(info: dict[str, Any]) -> str:
    since = info.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(since)) if isinstance(since, (int, float)) else "?"
    command = f" ({info['command']})" if info.get("command") else ""
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')} since {when}{command}"


class RunLock:
    """The lock of ``run_dir`` (created, parents too, if missing; directories it created are removed again on
    release if still empty, so a refused command leaves no trace). ``prog`` prefixes the note printed when a
    stale lock is taken over. Raises ``RunLockedError`` (one line: the holder, since when, and the fixes)."""

    def __init__(self, run_dir: str | Path, *, prog: str = "shardwise", command: str | None = None) -> None:
        self.run_dir, self.prog = Path(run_dir), prog
        self.path = self.run_dir / LOCK_FILE
        self.command = command if command is not None else " ".join(["shardwise", *sys.argv[1:]])[:300]
        self.note = ""
        """The one-line note of a stale lock taken over ('' otherwise)."""
        self._fd: int | None = None
        self._created: list[Path] = []

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _info(self) -> dict[str, Any]:
        pid = os.getpid()
        return {"pid": pid, "host": socket.gethostname(), "since": time.time(), "command": self.command,
                "pid_start": _proc_start(pid)}

    def _mkdirs(self) -> None:
        missing = [p for p in [self.run_dir, *self.run_dir.parents] if not p.exists()]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._created = missing  # deepest first

    def acquire(self) -> None:
        """Take the lock, or take over a stale one (printing ``note``); ``RunLockedError`` when it is held."""
        if self._fd is not None:
            return
        try:
            self._mkdirs()
            for _ in range(20):  # each retry follows a lock released or replaced between two looks
                if self._publish() or self._take_over():
                    return
            raise RunLockedError(f"run directory {str(self.run_dir)!r}: could not take {self.path} (it changes "
                                 f"under every attempt); retry, or pick another --train.name")
        except PermissionError as exc:
            self._remove_created()
            raise ValueError(f"run directory {str(self.run_dir)!r} is not writable ({exc.strerror}: "
                             f"{exc.filename}); pick another --train.out_dir or fix its permissions") from None
        except BaseException:
            self._remove_created()
            raise

    def _publish(self) -> bool:
        """Create the lock whole under a private name and link it into place; False if one exists already."""
        tmp = self.run_dir / f"{LOCK_FILE}.{os.getpid()}.{time.monotonic_ns()}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            _flock(fd)
            os.write(fd, json.dumps(self._info()).encode())
            os.fsync(fd)
            os.link(tmp, self.path)
        except FileExistsError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        finally:
            tmp.unlink(missing_ok=True)
        self._fd = fd
        return True

    def _take_over(self) -> bool:
        """Examine the existing lock: raise if its holder lives; take it over if stale; False to retry (it went
        away or was replaced while we looked)."""
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return False
        try:
            free = _flock(fd)
            if not _same_file(fd, self.path):
                os.close(fd)
                return False
            info = read_lock(self.path)
            here = info.get("host") == socket.gethostname()
            if not free or (here and _alive(info)) or (not here and info):
                raise RunLockedError(self._refusal(info, here))
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self._info()).encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.note = (f"{self.prog}: note: took over the stale lock {self.path} of {_describe(info)}: that process "
                     f"is gone" if info else f"{self.prog}: note: took over the unreadable stale lock {self.path}")
        print(self.note, file=sys.stderr, flush=True)
        return True

    def _refusal(self, info: dict[str, Any], here: bool) -> str:
        pid = info.get("pid", "?")
        fix = (f"wait for it to finish, pick another --train.name, or stop it (kill {pid})" if here else
               f"wait for it to finish or pick another --train.name; if that process is gone, delete {self.path}")
        return f"run directory {str(self.run_dir)!r} is in use by {_describe(info)}; {fix}"

    def release(self) -> None:
        """Remove the lock file and drop the flock (idempotent); then the directories it created, if empty."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                if _same_file(fd, self.path):
                    self.path.unlink(missing_ok=True)  # while still flocked: a waiter then finds no file and retries
            finally:
                os.close(fd)
        self._remove_created()

    def _remove_created(self) -> None:
        for directory in self._created:
            try:
                directory.rmdir()
            except OSError:
                break  # not empty: the command wrote something there (or another did), keep it and its parents
        self._created = []


def _flock(fd: int) -> bool:
    """Try an exclusive flock without waiting: True taken, False held by another open file. A file system
    without flock counts as taken (the pid check alone then decides)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        return True
    return True


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still the file at ``path`` (a releaser unlinks it; a flock on an unlinked file is no lock)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)
