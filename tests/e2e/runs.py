"""Helpers shared by the end-to-end tests that drive ``shardwise`` as a user would (a subprocess per command)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def cli(cwd: Path, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    """``shardwise ARGS`` in ``cwd`` (``python -m shardwise.cli``: the installed package, no PATH lookup)."""
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def losses(run_dir: Path) -> dict[int, float]:
    """Step -> logged loss of a run (its ``metrics.jsonl``; summary rows skipped)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "kind" not in r}


def resume_in_layout(baseline: Path, tmp_path: Path, layout: list[str], *extra: str) -> Path:
    """Copy a 6-step run with a step-3 checkpoint, resume that checkpoint in ``layout`` and assert steps 4-6
    repeat the uninterrupted run's losses (another layout sums in another order: equal up to float noise).
    Returns the resumed run's directory."""
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    proc = cli(tmp_path, "train", "--resume", str(run / "checkpoints" / "step_000003"), *extra, *layout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want, got = losses(baseline), losses(run)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got[step], want[step])
    return run
