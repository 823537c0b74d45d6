"""Run directories end to end: one writer at a time (``RUN/.lock``), and a pretrained run resumed from its own
checkpoint after its pretrained directory is gone.

The lock cases run ``shardwise.cli.main`` in this process with the rank launcher replaced (no rank starts) —
except the first, which starts a real run, stops its launcher (SIGSTOP: it holds the lock, whatever its ranks
do) and tries a second run with ``--overwrite`` into the same directory, as a user did by accident.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardwise import cli
from shardwise.runtime.run_lock import LOCK_FILE, RunLock, read_lock
from tests.e2e.runs import losses

TINY = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.warmup_steps", "2",
        "--train.log_every", "1", "--train.ckpt_every", "3", "--train.memory_check", "false"]


def _snapshot(root: Path) -> dict[str, tuple[int, str] | None]:
    return {str(p.relative_to(root)): (p.stat().st_size, hashlib.sha1(p.read_bytes()).hexdigest()) if p.is_file()
            else None for p in sorted(root.rglob("*"))}


def _fake_run(root: Path, name: str = "done", *, steps: int = 5) -> Path:
    """A finished run as ``shardwise train`` leaves it, without training: config, metrics, one checkpoint."""
    from shardwise.runtime.config import Config, TrainConfig

    run = root / "runs" / name
    ckpt = run / "checkpoints" / f"step_{steps:06d}"
    ckpt.mkdir(parents=True)
    cfg = Config(train=TrainConfig(name=name, steps=steps))
    (run / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6)))
    (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    (ckpt / "index.json").write_text(json.dumps({"format": "shardwise-sharded-v1", "step": steps,
                                                 "mesh": {"dp": 1, "tp": 1}, "world_size": 1, "state": {},
                                                 "tensors": {}}))
    return run


HOLDER = """
import sys, time
from shardwise.runtime.run_lock import RunLock
RunLock(sys.argv[1], command="shardwise train --train.name done").acquire()
print("held", flush=True)
time.sleep(300)
"""


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Launches recorded instead of run: each records who held the lock while the ranks would have run."""
    from shardwise.cli import train
    from shardwise.runtime import job

    calls: list[dict] = []

    def launch(nproc: int, target: list[str], **kwargs: object) -> int:
        run_dir = Path(target[target.index("--run-dir") + 1])
        calls.append(read_lock(run_dir / LOCK_FILE))
        return 1

    monkeypatch.setattr(job, "run_local", launch)
    monkeypatch.setattr(train, "_prediction", lambda *a, **k: None)  # no hardware probe
    return calls


@pytest.mark.parametrize("argv", [["--overwrite"], ["--resume", "runs/done", "--train.steps", "9"], []],
                         ids=["overwrite", "resume", "fresh"])
def test_a_run_being_written_refuses_a_second_command_and_is_untouched(argv, tmp_path, monkeypatch, capsys,
                                                                         no_ranks):
    monkeypatch.chdir(tmp_path)
    run = _fake_run(tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        before = _snapshot(tmp_path)
        rc = cli.main(["train", "--train.name", "done", "--optimizer.lr", "0.01", *argv])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and "\n" not in err, err
        assert f"'runs/done' is in use by pid {holder.pid} on host {socket.gethostname()}" in err, err
        assert f"kill {holder.pid}" in err and "another --train.name" in err
        assert _snapshot(tmp_path) == before  # metrics, config.json, checkpoints and the lock as they were
        assert no_ranks == []
    finally:
        holder.kill()
        holder.wait(timeout=60)


def test_verify_holds_the_lock_of_its_scratch_runs(tmp_path, monkeypatch, capsys, no_ranks):
    monkeypatch.chdir(tmp_path)
    scratch = tmp_path / "runs" / "verify-gpt-tiny"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(scratch)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert cli.main(["verify", "--parallel.nproc", "2", "--steps", "2"]) == 2
        err = capsys.readouterr().err
        assert f"shardwise verify: error: run directory '{scratch.relative_to(tmp_path)}' is in use by pid {holder.pid}" \
            in err, err
        assert sorted(p.name for p in scratch.iterdir()) == [LOCK_FILE] and no_ranks == []
    finally:
        holder.kill()
        holder.wait(timeout=60)


def test_a_stale_lock_is_taken_over_and_every_attempt_holds_the_lock_until_the_end(tmp_path, monkeypatch, capsys,
                                                                                 no_ranks):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    (run / LOCK_FILE).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "since": time.time()}))
    rc = cli.main(["train", "--train.name", "x", "--train.max_restarts", "2", *TINY])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"note: took over the stale lock runs/x/.lock of pid {dead.pid}" in err
    assert [c.get("pid") for c in no_ranks] == [os.getpid()] * 3  # the launch and both restarts, one lock
    assert not (run / LOCK_FILE).exists()  # released after the failed run


def test_an_interrupted_launch_releases_the_lock(tmp_path, monkeypatch):
    from shardwise.cli import train
    from shardwise.runtime import job

    def interrupted(*args: object, **kwargs: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "run_local", interrupted)
    monkeypatch.setattr(train, "_prediction", lambda *a, **k: None)
    with pytest.raises(KeyboardInterrupt):
        cli.main(["train", "--train.name", "y", *TINY])
    assert (tmp_path / "runs" / "y").is_dir() and not (tmp_path / "runs" / "y" / LOCK_FILE).exists()


def _wait_for_lock(path: Path, pid: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while read_lock(path).get("pid") != pid:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never took its lock"
        time.sleep(0.05)


def test_overwrite_into_a_running_run_is_refused_and_the_run_completes_alone(tmp_path):
    first = subprocess.Popen([sys.executable, "-m", "shardwise.cli", "train", "--train.name", "r", "--train.steps",
                              "6", *TINY], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = tmp_path / "runs" / "r"
    try:
        _wait_for_lock(run / LOCK_FILE, first.pid, first)
        first.send_signal(signal.SIGSTOP)  # the launcher holds the lock for as long as it lives
        second = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--train.name", "r", "--train.steps",
                                 "6", "--optimizer.lr", "0.01", "--overwrite", *TINY], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300)
    finally:
        first.send_signal(signal.SIGCONT)
    out, err = first.communicate(timeout=600)
    assert second.returncode == 2 and f"is in use by pid {first.pid}" in second.stderr, second.stderr
    assert first.returncode == 0, out[-3000:] + err[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "kind" not in r] == [1, 2, 3, 4, 5, 6]  # one run's steps, once each
    assert json.loads((run / "config.json").read_text())["optimizer"]["lr"] == 3e-3  # the first run's default
    assert not (run / LOCK_FILE).exists()  # released after a normal run


def _resume_step2(base: Path, run: Path, cwd: Path) -> dict[str, dict]:
    """Copy ``base`` without its step-4 checkpoint into ``run`` and resume it to step 4; the steps 3-4 must be the
    uninterrupted run's. Returns the resumed run's config.json and rank 0's summary."""
    shutil.copytree(base, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--resume", str(run)], cwd=cwd,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    want, got = losses(base), losses(run)
    assert sorted(got) == [1, 2, 3, 4]
    for step in (3, 4):  # float noise only (measured: 5e-7 relative, as for a plain GPT resumed on one process)
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=0), (step, got[step], want[step])
    return {"config": json.loads((run / "config.json").read_text()),
            "summary": json.loads((run / "ranks" / "rank00000.json").read_text())}


def test_a_pretrained_run_resumes_from_its_own_checkpoint_after_the_directory_is_gone(tmp_path):
    import torch

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=64, tie_word_embeddings=False))
    pretrained = tmp_path / "my-llama"
    model.save_pretrained(pretrained)
    flags = ["--model.pretrained", str(pretrained), "--model.block_size", "32", "--parallel.nproc", "1",
             "--train.steps", "4", "--train.ckpt_every", "2", "--data.global_batch", "4", "--parallel.micro_batch", "2",
             "--optimizer.warmup_steps", "0", "--train.log_every", "1", "--train.memory_check", "false"]
    full = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", *flags], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    base = tmp_path / "runs" / "my-llama"  # named after the pretrained directory
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    assert json.loads((base / "ranks" / "rank00000.json").read_text())["pretrained_bytes_read"] > 0
    # the directory still there: kept as where the run began, but the weights come from the checkpoint
    kept = _resume_step2(base, tmp_path / "kept", tmp_path)
    assert kept["config"]["model"]["pretrained"] == str(pretrained) and kept["summary"]["pretrained_bytes_read"] == 0
    shutil.rmtree(pretrained)
    gone = _resume_step2(base, tmp_path / "gone", tmp_path)
    model_cfg = gone["config"]["model"]
    assert model_cfg["pretrained"] == "" and Path(model_cfg["hf_config"]) == (tmp_path / "gone" / "hf_config.json").resolve()
