"""The trials of the fault campaign (``benchmarks/faults_campaign.py``): real ``shardwise train`` launches, one fault each, then the checks.

Every trial starts ``python -m shardwise.cli train`` in a directory of its own, injects one fault from the
outside (a signal to a rank or to the launcher, or a flipped byte in a finished checkpoint), measures how the
job ended, and checks what it left: the newest checkpoint verifies, a ``--resume`` reproduces the losses of the
uninterrupted reference run exactly. All random choices come from the campaign's one ``random.Random``.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from shardwise.checkpoint.sharded import CheckpointError, latest_checkpoint, latest_intact_checkpoint, verify_checkpoint
from shardwise.runtime.metrics import read_metrics
from shardwise.runtime.supervisor import child_processes

__all__ = ["Setup", "Launch", "Reference", "run_reference", "KINDS", "empty_record", "trial_kill_rank",
           "trial_kill_in_save", "trial_kill_launcher", "trial_sigstop_rank", "resume"]

KINDS = ("kill-rank", "kill-in-save", "kill-launcher", "sigstop-rank", "corrupt-piece")
_POLL_S = 0.005
_START_TIMEOUT_S = 300.0
_JOB_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Setup:
    """The campaign's fixed run configuration."""

    workdir: Path
    steps: int = 40
    ckpt_every: int = 4
    keep: int = 3
    timeout_s: float = 10.0
    nproc: int = 2

    def train_argv(self, run_dir: Path, *, ckpt_every: int | None = None) -> list[str]:
        """The ``shardwise train`` command of a fresh run into ``run_dir``."""
        return [sys.executable, "-m", "shardwise.cli", "train", "--parallel.nproc", str(self.nproc),
                "--train.steps", str(self.steps), "--train.ckpt_every", str(ckpt_every or self.ckpt_every),
                "--train.keep_checkpoints", str(self.keep), "--train.timeout_s", f"{self.timeout_s:g}",
                "--train.log_every", "1", "--train.out_dir", str(run_dir)]


@dataclass
class Launch:
    """A running ``shardwise train`` launcher, its output files and its start time (monotonic)."""

    proc: subprocess.Popen
    run_dir: Path
    t0: float
    stdout: Path
    stderr: Path

    @staticmethod
    def start(argv: list[str], run_dir: Path, tag: str) -> "Launch":
        """Start ``argv`` with stdout/stderr to ``run_dir.parent/NAME.TAG.{out,err}``."""
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        out, err = (run_dir.parent / f"{run_dir.name}.{tag}.{ext}" for ext in ("out", "err"))
        with out.open("w") as fo, err.open("w") as fe:
            proc = subprocess.Popen(argv, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, start_new_session=True)
        return Launch(proc, run_dir, time.monotonic(), out, err)

    def ranks(self, nproc: int, timeout: float = _START_TIMEOUT_S) -> dict[int, int]:
        """rank → pid of the launcher's live rank children, once all ``nproc`` are up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            kids = {c.rank: pid for pid, c in child_processes(self.proc.pid).items()
                    if c.rank is not None and not c.zombie}
            if len(kids) == nproc:
                return kids
            time.sleep(0.05)
        raise RuntimeError(f"{self.run_dir}: the launcher did not start {nproc} ranks (rc {self.proc.poll()})")

    def wait(self, timeout: float = _JOB_TIMEOUT_S) -> int | None:
        """The launcher's exit code, or None (after killing it) when it outlives ``timeout``."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None


def step_of(run_dir: Path, rank: int) -> int | None:
    """The step ``rank`` last started (``RUN/ranks/rankNNNNN.step``), or None."""
    try:
        text = (run_dir / "ranks" / f"rank{rank:05d}.step").read_text().split()
        return int(text[0]) if text else None
    except (OSError, ValueError):
        return None


def wait_for(cond: Callable[[], bool], launch: Launch, timeout: float = _START_TIMEOUT_S) -> bool:
    """Poll ``cond`` until true (True) or the launcher ends / time runs out (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and launch.proc.poll() is None:
        if cond():
            return True
        time.sleep(_POLL_S)
    return cond()


def first_checkpoint(launch: Launch) -> bool:
    """Wait until the run has published its first checkpoint."""
    return wait_for(lambda: (launch.run_dir / "checkpoints" / "latest").is_file(), launch)


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def reap(pids: list[int]) -> int:
    """SIGCONT then SIGKILL every pid in ``pids`` still alive; how many there were (hygiene after a trial)."""
    left = [p for p in pids if alive(p)]
    for pid in left:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    return len(left)


@dataclass
class Reference:
    """The uninterrupted reference run: its losses by step and its timing (for the kill window)."""

    run_dir: Path
    losses: dict[int, float]
    window_s: float
    """Seconds from the first published checkpoint to the start of the last step."""
    step_s: float
    """Mean seconds per step in that window."""
    total_s: float
    rc: int | None


def run_reference(setup: Setup, attempts: int = 3) -> tuple[Reference, list[str]]:
    """The reference run, retried (into a fresh directory) up to ``attempts`` times if it fails: an overloaded
    machine can starve a rank past ``timeout_s``. Returns it and the failure reports of the attempts before."""
    failures: list[str] = []
    for attempt in range(attempts):
        try:
            return _reference(setup, setup.workdir / f"reference{'-' + str(attempt) if attempt else ''}"), failures
        except RuntimeError as exc:
            failures.append(str(exc))
            print(f"reference run failed: {exc}", file=sys.stderr, flush=True)
    raise RuntimeError("the reference run failed " + str(attempts) + " times: " + " | ".join(failures))


def _reference(setup: Setup, run_dir: Path) -> Reference:
    """Run the reference job once, timing the window in which faults are injected."""
    launch = Launch.start(setup.train_argv(run_dir), run_dir, "train")
    first_checkpoint(launch)
    t_ckpt = time.monotonic()
    wait_for(lambda: (step_of(run_dir, 0) or 0) >= setup.steps, launch)
    t_last = time.monotonic()
    rc = launch.wait()
    if rc != 0:
        raise RuntimeError(f"rc {rc}: {failure_line(launch.stderr)[:300]} (see {launch.stderr})")
    losses = {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}
    window = max(t_last - t_ckpt, 0.1)
    return Reference(run_dir, losses, window, window / (setup.steps - setup.ckpt_every), time.monotonic() - launch.t0,
                     rc)


def empty_record(kind: str, trial: int, seed: int) -> dict[str, Any]:
    """Every column, n/a (None) until the trial fills it in."""
    return {"kind": kind, "trial": trial, "seed": seed, "victim": None, "target_step": None, "kill_frac": None,
            "kill_at_s": None, "kill_step": None, "exit_s": None, "exit_code": None, "named": None, "loadable": None,
            "resumed_identical": None, "detected": None, "in_save": None, "quiet_after": None,
            "within_goal": None, "leftovers": None, "report": None, "resume_rc": None, "note": ""}


def failure_line(stderr: Path) -> str:
    """The launcher's final failure report (the last ``shardwise train: the job failed`` line), or ''."""
    lines = [ln for ln in stderr.read_text(errors="replace").splitlines() if "shardwise train: the job failed" in ln]
    return lines[-1] if lines else ""


def names_rank(report: str, victim: int, nproc: int) -> bool:
    """The report names ``victim`` and blames no other rank."""
    others = [r for r in range(nproc) if r != victim and re.search(rf"\brank {r} failed", report)]
    return bool(re.search(rf"\brank {victim}\b", report)) and not others


def loadable(run_dir: Path) -> bool:
    """The checkpoint ``latest`` points to passes ``verify_checkpoint``."""
    try:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            return False
        verify_checkpoint(ckpt)
        return True
    except (CheckpointError, OSError):
        return False


def same_losses(run_dir: Path, ref: Reference) -> bool:
    """Every step 1..N appears once in ``metrics.jsonl`` with exactly the reference loss."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r.get("step") for r in rows]
    if sorted(steps) != sorted(ref.losses) or len(set(steps)) != len(steps):
        return False
    return all(r["loss"] == ref.losses[r["step"]] for r in rows)


def resume(setup: Setup, run_dir: Path, rec: dict[str, Any], ref: Reference) -> Launch | None:
    """``shardwise train --resume RUN`` to the same step count, then compare the losses with the reference.
    A run whose newest intact checkpoint is already the final step needs no resume."""
    ckpt, _ = latest_intact_checkpoint(run_dir)
    launch = None
    if ckpt is None or int(ckpt.name.split("_")[-1]) < setup.steps:
        argv = [sys.executable, "-m", "shardwise.cli", "train", "--resume", str(run_dir),
                "--train.steps", str(setup.steps)]
        launch = Launch.start(argv, run_dir, "resume")
        rec["resume_rc"] = launch.wait()
    else:
        rec["note"] += "final checkpoint already published; no resume needed. "
    rec["resumed_identical"] = rec["resume_rc"] in (None, 0) and same_losses(run_dir, ref) if launch else \
        same_losses(run_dir, ref)
    return launch


def _tmp_saves(run_dir: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(run_dir / "checkpoints") if e.name.startswith(".tmp-step_")]
    except OSError:
        return []


def _kill_at_random(setup: Setup, ref: Reference, rng: random.Random, rec: dict[str, Any], *, watch: int = 0,
                    ckpt_every: int | None = None) -> tuple[Launch, dict[int, int]]:
    """Start a run and wait until a random point of its training window: rank ``watch`` starting a random step
    after the first checkpoint, plus a random fraction of the reference's step time (a schedule in steps, not
    seconds, so a run slower or faster than the reference on a shared machine still gets its fault). Returns
    the launch and its rank pids (the fault is the caller's). The RNG draws come first: a seed fixes them."""
    every = ckpt_every or setup.ckpt_every
    target, frac = rng.randint(every + 1, setup.steps - 1), rng.random()
    rec["target_step"], rec["kill_frac"] = target, round(frac, 4)
    run_dir = setup.workdir / f"{rec['kind']}-{rec['trial']:03d}"
    launch = Launch.start(setup.train_argv(run_dir, ckpt_every=ckpt_every), run_dir, "train")
    pids = launch.ranks(setup.nproc)
    if not wait_for(lambda: (step_of(run_dir, watch) or 0) >= target, launch):
        raise RuntimeError(f"{run_dir}: rank {watch} never reached step {target} (rc {launch.proc.poll()})")
    deadline = time.monotonic() + frac * ref.step_s
    while time.monotonic() < deadline and launch.proc.poll() is None:
        time.sleep(_POLL_S)
    return launch, pids


def _signal_rank(setup: Setup, ref: Reference, rng: random.Random, rec: dict[str, Any], sig: int,
                 ckpt_every: int | None = None) -> tuple[Launch, dict[int, int], float]:
    """Signal a random rank at a random time; returns (launch, rank pids, the fault's monotonic time)."""
    victim = rng.randrange(setup.nproc)
    rec["victim"] = victim
    launch, pids = _kill_at_random(setup, ref, rng, rec, watch=victim, ckpt_every=ckpt_every)
    if sig == signal.SIGKILL and ckpt_every == 1:  # land inside a save: wait (bounded) for one to be in progress
        wait_for(lambda: bool(_tmp_saves(launch.run_dir)), launch, timeout=2.0)
    before = bool(_tmp_saves(launch.run_dir))
    rec["kill_step"] = step_of(launch.run_dir, victim)
    t_fault = time.monotonic()
    os.kill(pids[victim], sig)
    if ckpt_every == 1:
        rec["in_save"] = before and bool(_tmp_saves(launch.run_dir))
    rec["kill_at_s"] = round(t_fault - launch.t0, 3)
    return launch, pids, t_fault


def _finish(setup: Setup, launch: Launch, pids: dict[int, int], t_fault: float, rec: dict[str, Any]) -> None:
    """Wait for the launcher, then record exit time/code and whether its report names the victim."""
    rec["exit_code"] = launch.wait()
    rec["exit_s"] = round(time.monotonic() - t_fault, 3)
    rec["leftovers"] = reap(list(pids.values()))
    rec["report"] = failure_line(launch.stderr)
    rec["named"] = names_rank(rec["report"], rec["victim"], setup.nproc)
    rec["loadable"] = loadable(launch.run_dir)
    keep_evidence(launch.run_dir)


def keep_evidence(run_dir: Path) -> None:
    """Copy ``RUN/ranks`` (step, error, ``.killed`` files of the failed attempt) to ``RUN/ranks.fault``: the
    resume clears it."""
    if (run_dir / "ranks").is_dir():
        shutil.copytree(run_dir / "ranks", run_dir / "ranks.fault", dirs_exist_ok=True)


def trial_kill_rank(setup: Setup, ref: Reference, rng: random.Random, rec: dict[str, Any]) -> None:
    """``kill -9`` a random rank at a random time in the training window."""
    launch, pids, t_fault = _signal_rank(setup, ref, rng, rec, signal.SIGKILL)
    _finish(setup, launch, pids, t_fault, rec)
    resume(setup, launch.run_dir, rec, ref)


def trial_kill_in_save(setup: Setup, ref: Reference, rng: random.Random, rec: dict[str, Any]) -> None:
    """``kill -9`` a random rank while a checkpoint is being written (``ckpt_every`` 1)."""
    launch, pids, t_fault = _signal_rank(setup, ref, rng, rec, signal.SIGKILL, ckpt_every=1)
    _finish(setup, launch, pids, t_fault, rec)
    resume(setup, launch.run_dir, rec, ref)


def trial_sigstop_rank(setup: Setup, ref: Reference, rng: random.Random, rec: dict[str, Any]) -> None:
    """``kill -STOP`` a random rank: the job must end within ``timeout_s`` + 10 s, naming it."""
    launch, pids, t_fault = _signal_rank(setup, ref, rng, rec, signal.SIGSTOP)
    _finish(setup, launch, pids, t_fault, rec)
    rec["within_goal"] = rec["exit_s"] <= setup.timeout_s + 10 and rec["exit_code"] is not None
    resume(setup, launch.run_dir, rec, ref)


def _snapshot(run_dir: Path) -> tuple[str, tuple[str, ...]]:
    root = run_dir / "checkpoints"
    latest = (root / "latest").read_text() if (root / "latest").is_file() else ""
    return latest, tuple(sorted(os.listdir(root))) if root.is_dir() else ()


def trial_kill_launcher(setup: Setup, ref: Reference, rng: random.Random, rec: dict[str, Any]) -> None:
    """``kill -9`` the launcher: every rank must be gone promptly and nothing written afterwards."""
    rec["victim"] = "launcher"
    launch, pids = _kill_at_random(setup, ref, rng, rec)
    rec["kill_step"] = step_of(launch.run_dir, 0)
    t_fault = time.monotonic()
    os.kill(launch.proc.pid, signal.SIGKILL)
    rec["kill_at_s"] = round(t_fault - launch.t0, 3)
    rec["exit_code"] = launch.wait()
    deadline = t_fault + 60
    while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    rec["exit_s"] = round(time.monotonic() - t_fault, 3)
    rec["leftovers"] = reap(list(pids.values()))
    before = _snapshot(launch.run_dir)
    time.sleep(5.0)
    rec["quiet_after"] = _snapshot(launch.run_dir) == before
    rec["loadable"] = loadable(launch.run_dir)
    resume(setup, launch.run_dir, rec, ref)
