"""How a script that calls ``sw.init()`` ends under ``shardwise run``: without ``sw.shutdown()`` it still exits 0
with its output whole (the exit hook tears down before the interpreter finalises; a gloo worker thread left
to finish a collective during finalisation used to abort the rank, SIGABRT); a raised exception and
``sys.exit(3)`` keep their exit codes and traceback; ``atexit`` handlers a script registers after ``init`` run
first, with the process group still usable; no deprecation warning or torchrun banner on stderr; Ctrl-C
stops the job with one line and exit code 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

BOXING = textwrap.dedent("""
    import atexit, torch, shardwise as sw
    world = sw.init()
    mesh = sw.Mesh(dp=-1)
    full = torch.arange(20.0).reshape(4, 5)
    x = sw.distribute(full, mesh, "S(0)")
    got = x.to_sbp("B").to_local()                      # an all-gather on gloo's worker threads
    ones = torch.ones(3)

    def late() -> None:                                  # registered after init: runs before the exit hook
        sw.comm.all_reduce(ones, mesh, "dp")
        print(f"atexit rank {world.rank} sum={ones[0].item():g}", flush=True)

    atexit.register(late)
    print(f"rank {world.rank} total={got.sum().item():g}", flush=True)
""")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # the conftest sets it; a user's shell does not
    return env


def _run(tmp_path: Path, code: str, *args: str, timeout: int = 90) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(code)
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "run", *args, str(script)], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, env=_env())


def test_a_script_without_shutdown_exits_cleanly_every_time(tmp_path):
    want = sum(range(20))  # the full tensor's sum: what every rank's gathered copy must hold
    for attempt in range(3):
        proc = _run(tmp_path, BOXING, "-n", "2")
        assert proc.returncode == 0, (attempt, proc.stderr[-3000:])
        for rank in (0, 1):
            assert f"rank {rank} total={want}" in proc.stdout, (attempt, proc.stdout)
            assert f"atexit rank {rank} sum=2" in proc.stdout, (attempt, proc.stdout)
        assert "terminate called" not in proc.stderr
        assert "FutureWarning" not in proc.stderr, proc.stderr
        assert "OMP_NUM_THREADS" not in proc.stderr, proc.stderr


def test_a_script_that_raises_fails_with_its_traceback(tmp_path):
    code = "import shardwise as sw\nsw.init()\nraise RuntimeError('boom from the script')\n"
    proc = _run(tmp_path, code, "-n", "2")
    assert proc.returncode != 0
    assert "Traceback" in proc.stderr and "RuntimeError: boom from the script" in proc.stderr


def test_sys_exit_keeps_its_code(tmp_path):
    code = "import sys, shardwise as sw\nsw.init()\nprint('before exit', flush=True)\nsys.exit(3)\n"
    script = tmp_path / "job.py"
    script.write_text(code)
    alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert alone.returncode == 3 and "before exit" in alone.stdout, alone.stderr
    proc = _run(tmp_path, code, "-n", "2")  # torchrun fails the job and names each rank's own exit code
    assert proc.returncode != 0 and "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]


def test_shutdown_then_exit(tmp_path):
    code = textwrap.dedent("""
        import torch, shardwise as sw
        world = sw.init()
        x = sw.comm.all_reduce(torch.ones(2), sw.Mesh(dp=-1), "dp")
        sw.shutdown()
        sw.shutdown()                                    # idempotent
        print(f"rank {world.rank} sum={x[0].item():g}", flush=True)
    """)
    proc = _run(tmp_path, code, "-n", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 sum=2" in proc.stdout and "rank 1 sum=2" in proc.stdout


def test_ctrl_c_stops_the_job_with_one_line_and_130(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import time, torch, shardwise as sw
        world = sw.init()
        mesh = sw.Mesh(dp=-1)
        print(f"ready {world.rank}", flush=True)
        if world.rank == 0:
            time.sleep(120)
        sw.comm.all_reduce(torch.ones(2), mesh, "dp")   # rank 1 waits here for rank 0
    """))
    # A terminal sends Ctrl-C to its foreground process group: the launcher's (torchrun starts the ranks in
    # sessions of their own).
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "run", "-n", "2", str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=_env(),
                            start_new_session=True)
    try:
        ready = 0
        while ready < 2:
            line = proc.stdout.readline()
            assert line, "the ranks ended before they were ready: " + proc.stderr.read()[-3000:]
            ready += line.count("ready")  # two ranks' prints may share a line (unbuffered: text, then newline)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == ["shardwise: interrupted (Ctrl-C): ranks stopped"], err


def test_teardown_order_and_rearming_in_a_world_of_one(tmp_path):
    """Steps registered with ``on_teardown`` run newest first, once; ``shutdown`` is idempotent; a second
    ``init`` after it is torn down again at exit (seen by an ``atexit`` handler registered before ``init``,
    which runs after the exit hook)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import atexit, torch.distributed as dist, shardwise as sw
        from shardwise.world import on_teardown
        atexit.register(lambda: print(f"at exit initialised={dist.is_initialized()}", flush=True))
        sw.init()
        on_teardown(lambda: print("step a", flush=True))
        on_teardown(lambda: print("step b", flush=True))
        sw.shutdown()
        sw.shutdown()
        print(f"after shutdown initialised={dist.is_initialized()}", flush=True)
        sw.init()
        print(f"again initialised={dist.is_initialized()}", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["step b", "step a", "after shutdown initialised=False",
                                        "again initialised=True", "at exit initialised=False"], proc.stdout


def test_ctrl_c_stops_shardwise_train_with_one_line_and_130(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", "--parallel.nproc", "2",
                             "--train.steps", "100000", "--train.out_dir", "runs", "--train.name", "x"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=_env(),
                            start_new_session=True)
    try:
        while True:  # training has started once a step line is out
            line = proc.stdout.readline()
            assert line, "shardwise train ended before its first step line"
            if line.startswith("step"):
                break
        os.killpg(proc.pid, signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, rest
    lines = [ln for ln in rest.splitlines() if not ln.startswith("step")]  # a step line may still be on its way
    assert len(lines) == 1 and lines[0].startswith("shardwise train: stopped: interrupted (Ctrl-C) at step"), rest
    assert "timeout" not in lines[0], rest
