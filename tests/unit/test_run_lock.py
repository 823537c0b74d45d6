"""``RUN/.lock`` (``shardwise/runtime/run_lock.py``): one writer per run directory.

The holders are real processes (a child that takes the lock and waits), so liveness is what the kernel says: a
live holder refuses everyone, a killed one (SIGKILL: no cleanup ran, the file stays) leaves a stale lock that the
next command takes over; a lock file naming a dead pid, or another host, is judged without any flock.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.runtime.run_lock import LOCK_FILE, RunLock, RunLockedError, read_lock

HOLDER = """
import sys, time
from shardwise.runtime.run_lock import RunLock
lock = RunLock(sys.argv[1], command="holder")
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid  # reaped: no process has this pid now (barring reuse in the next instant)


def test_a_live_holder_refuses_a_second_command_with_its_pid_host_and_the_fixes(tmp_path):
    run = tmp_path / "runs" / "r"
    holder = _holder(run)
    try:
        with pytest.raises(RunLockedError) as err:
            RunLock(run).acquire()
        line = str(err.value)
        assert "\n" not in line
        for part in (f"pid {holder.pid}", f"host {socket.gethostname()}", "since ", "(holder)", "wait for it",
                     "another --train.name", f"kill {holder.pid}"):
            assert part in line, (part, line)
        assert read_lock(run / LOCK_FILE)["pid"] == holder.pid  # the refused command changed nothing
    finally:
        holder.kill()
        holder.wait(timeout=60)


def test_a_killed_holder_leaves_a_stale_lock_that_is_taken_over(tmp_path, capsys):
    run = tmp_path / "r"
    holder = _holder(run)
    holder.send_signal(signal.SIGKILL)  # no cleanup: the file stays, the kernel drops the flock
    holder.wait(timeout=60)
    assert (run / LOCK_FILE).exists()
    with RunLock(run, prog="shardwise train") as lock:
        assert read_lock(run / LOCK_FILE)["pid"] == os.getpid()
        assert f"pid {holder.pid}" in lock.note and "is gone" in lock.note
    assert "shardwise train: note: took over the stale lock" in capsys.readouterr().err
    assert not (run / LOCK_FILE).exists()


def test_a_lock_file_naming_a_dead_pid_is_taken_over(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    dead = _dead_pid()
    (run / LOCK_FILE).write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "since": time.time() - 60,
                                             "command": "shardwise train"}))
    with RunLock(run) as lock:
        assert f"pid {dead}" in lock.note
        assert read_lock(run / LOCK_FILE)["pid"] == os.getpid()


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / LOCK_FILE).write_text(json.dumps({"pid": 4242, "host": "elsewhere.example", "since": time.time()}))
    with pytest.raises(RunLockedError) as err:
        RunLock(run).acquire()
    assert "pid 4242 on host elsewhere.example" in str(err.value)
    assert f"delete {run / LOCK_FILE}" in str(err.value)  # its process cannot be checked from here


def test_one_process_cannot_take_it_twice_and_release_frees_it(tmp_path):
    run = tmp_path / "r"
    first = RunLock(run)
    first.acquire()
    with pytest.raises(RunLockedError):
        RunLock(run).acquire()  # a flock belongs to an open file, not to a process
    first.release()
    first.release()  # idempotent
    assert not (run / LOCK_FILE).exists()
    with RunLock(run):
        pass


def test_release_removes_only_the_directories_it_created_and_left_empty(tmp_path):
    with RunLock(tmp_path / "runs" / "a"):
        pass
    assert not (tmp_path / "runs").exists()  # a refused or empty command leaves no trace
    with RunLock(tmp_path / "runs" / "b"):
        (tmp_path / "runs" / "b" / "metrics.jsonl").write_text("{}\n")
    assert (tmp_path / "runs" / "b" / "metrics.jsonl").exists() and not (tmp_path / "runs" / "b" / LOCK_FILE).exists()
    existing = tmp_path / "kept"
    existing.mkdir()
    with RunLock(existing):
        pass
    assert existing.is_dir()


def test_a_child_outliving_its_launcher_does_not_keep_the_run_locked(tmp_path):
    """Ranks are children of the launcher: the lock's descriptor is not inherited (even with ``close_fds=False``),
    so a launcher killed while a child lives on leaves a lock that is stale."""
    run = tmp_path / "r"
    code = HOLDER.replace('print("held"', 'import subprocess; kid = subprocess.Popen([sys.executable, "-c", '
                          '"import time; time.sleep(120)"], close_fds=False); print(kid.pid, flush=True); print("held"')
    holder = subprocess.Popen([sys.executable, "-c", code, str(run)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None
    kid = int(holder.stdout.readline())
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()
        holder.wait(timeout=60)
        os.kill(kid, 0)  # the child still runs
        with RunLock(run) as lock:
            assert f"pid {holder.pid}" in lock.note
    finally:
        os.kill(kid, signal.SIGKILL)
