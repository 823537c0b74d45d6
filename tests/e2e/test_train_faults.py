"""``shardwise train`` under faults, end to end: a stopped rank, a killed launcher, elastic restarts, a damaged
latest checkpoint, a resume that must change nothing, and a two-node job on this machine.

The reference for losses is an uninterrupted run of the same config (bit-for-bit equal: a resume restores
weights, optimizer state, data position and RNG).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise.checkpoint.sharded import Checkpoint, latest_checkpoint
from shardwise.runtime.supervisor import child_processes

TINY = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.warmup_steps", "2",
        "--train.log_every", "1", "--train.steps", "8", "--train.ckpt_every", "2", "--train.keep_checkpoints", "3"]


def cli(cwd: Path, *args: str, timeout: int = 150, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "kind" not in r}  # not the launcher's prediction/summary


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted dp=2 run of 8 steps, checkpoints at 2, 4, 6, 8 (the last three kept)."""
    cwd = tmp_path_factory.mktemp("reference")
    proc = cli(cwd, "train", *TINY, "--train.name", "ref")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / "ref"


def test_restart_resumes_from_latest_intact_and_matches_uninterrupted(reference, tmp_path):
    proc = cli(tmp_path, "train", *TINY, "--train.name", "ref", "--train.max_restarts", "1",
               "--debug.kill_rank", "1", "--debug.kill_step", "5")
    assert proc.returncode == 0, proc.stderr
    assert "restart 1/1: resuming from" in proc.stderr and "step_000004" in proc.stderr
    assert "rank 1 failed first" in proc.stderr
    assert losses(tmp_path / "runs" / "ref") == losses(reference)


def test_restarts_used_up_report_the_failure(tmp_path):
    proc = cli(tmp_path, "train", *TINY, "--train.name", "r", "--train.steps", "4", "--debug.kill_rank", "0",
               "--debug.kill_step", "3")
    assert proc.returncode != 0 and "restart" not in proc.stderr
    assert "rank 0 failed first" in proc.stderr


def test_sigstopped_rank_ends_the_job_within_timeout_plus_10s_named(tmp_path):
    timeout_s = 4
    launcher = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", *TINY, "--train.name", "stop",
                                 "--train.steps", "100000", "--train.timeout_s", str(timeout_s)],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = _rank_pid(launcher.pid, rank=1, run_dir=tmp_path / "runs" / "stop", after_step=3)
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=timeout_s + 40)
        elapsed = time.monotonic() - start
    finally:
        launcher.kill()
    assert launcher.returncode != 0
    assert elapsed <= timeout_s + 10, f"the job took {elapsed:.1f} s to end after rank 1 was stopped"
    assert "rank 1 failed first" in err and "rank 1 did not exit after the failure and was killed" in err
    with pytest.raises(ProcessLookupError):
        os.kill(victim, 0)


def test_killing_the_launcher_stops_its_ranks(tmp_path):
    run_dir = tmp_path / "runs" / "orphan"
    launcher = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", *TINY, "--train.name", "orphan",
                                 "--train.steps", "100000", "--train.ckpt_every", "1"],
                                cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _rank_pid(launcher.pid, rank=0, run_dir=run_dir, after_step=3)
        ranks = list(child_processes(launcher.pid))
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "a rank outlived its launcher"
        before = snapshot(run_dir / "checkpoints")
        time.sleep(2)
        assert snapshot(run_dir / "checkpoints") == before  # nobody keeps writing
    finally:
        launcher.kill()


def _rank_pid(launcher: int, *, rank: int, run_dir: Path, after_step: int, timeout: float = 90) -> int:
    """The pid of ``rank`` once it has started step ``after_step`` (so the job is past start-up)."""
    deadline = time.monotonic() + timeout
    step_file = run_dir / "ranks" / f"rank{rank:05d}.step"
    while time.monotonic() < deadline:
        kids = {c.rank: pid for pid, c in child_processes(launcher).items()}
        text = step_file.read_text().strip() if step_file.is_file() else ""
        if rank in kids and text and int(text.split()[0]) > after_step:
            return kids[rank]
        time.sleep(0.05)
    raise AssertionError(f"rank {rank} did not reach step {after_step} within {timeout} s")


def test_damaged_latest_falls_back_with_a_warning(reference, tmp_path):
    run = tmp_path / "ref"
    subprocess.run(["cp", "-r", str(reference), str(run)], check=True)
    latest = latest_checkpoint(run)
    piece = latest / "rank00000.safetensors"
    data = bytearray(piece.read_bytes())
    data[-16:-8] = bytes(b ^ 0xFF for b in data[-16:-8])  # inside the last tensor's data
    piece.write_bytes(bytes(data))
    proc = cli(tmp_path, "train", "--resume", str(run))  # the damaged latest is step 8 = train.steps
    assert proc.returncode == 0, proc.stderr
    assert f"skipping damaged checkpoint {latest}" in proc.stderr and "checksum" in proc.stderr
    assert "resuming from the newest intact checkpoint" in proc.stderr and "step_000006" in proc.stderr
    got, want = losses(run), losses(reference)
    assert [got[s] for s in (7, 8)] == [want[s] for s in (7, 8)]  # steps 7, 8 recomputed from step 6
    explicit = cli(tmp_path, "export", str(reference / "checkpoints" / "step_000008"), "--out", "m.safetensors")
    assert explicit.returncode == 0, explicit.stderr


def test_a_failed_resume_changes_nothing(reference, tmp_path, monkeypatch, capsys):
    from shardwise import cli as cli_module
    from shardwise.runtime import job

    run = tmp_path / "ref"
    subprocess.run(["cp", "-r", str(reference), str(run)], check=True)
    before = snapshot(run)
    monkeypatch.setattr(job, "run_local", lambda *a, **k: pytest.fail("a rank was started"))
    for flags in (["--model.n_embd", "32"], ["--train.steps", "8"], ["--parallel.tp", "3"]):
        assert cli_module.main(["train", "--resume", str(run), *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "error" in err, err
        assert snapshot(run) == before
    assert "model.n_embd = 32 (saved 64)" in _last_error(run, capsys, monkeypatch)
    assert Checkpoint(run).step == 8


def _last_error(run: Path, capsys, monkeypatch) -> str:
    from shardwise import cli as cli_module

    cli_module.main(["train", "--resume", str(run), "--model.n_embd", "32", "--train.steps", "10"])
    return capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_launchers_train_like_one_node(reference, tmp_path):
    """``--nnodes 2`` with two launchers on this machine (one rank each, a shared run directory) gives the
    losses of one node with the same world size (the reference run: 2 ranks on one node). One intra-op thread:
    torchrun sets it only for several ranks per node, and the thread count changes float summation order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", *TINY, "--train.name", "mn",
                               "--parallel.nproc", "2", "--nnodes", "2", "--node-rank", str(r),
                               "--rdzv-endpoint", endpoint], cwd=tmp_path, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in (1, 0)]
    outs = [p.communicate(timeout=150) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert losses(tmp_path / "runs" / "mn") == losses(reference)
    assert Checkpoint(tmp_path / "runs" / "mn").index["world_size"] == 2


@pytest.mark.parametrize("flags, expected", [
    (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank 2 must be in 0..1"),
    (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "must be HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--parallel.nproc", "3"], "must be a multiple of --nnodes 2"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--train.max_restarts", "1"], "is not supported"),
])
def test_bad_multinode_flags(tmp_path, monkeypatch, capsys, flags, expected):
    from shardwise import cli as cli_module
    from shardwise.runtime import job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "run_local", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli_module.main(["train", "--data.global_batch", "24", "--parallel.micro_batch", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir())  # nothing written
