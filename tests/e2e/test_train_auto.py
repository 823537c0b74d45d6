"""``shardwise train --parallel.auto true``: the planner chooses the layout (given parallel flags are pins), the
run trains with it to the same losses as the layout written by hand, and reports predicted vs measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

TINY = ["--data.global_batch", "8", "--optimizer.warmup_steps", "2", "--train.log_every", "1", "--train.steps", "3",
        "--train.ckpt_every", "0", "--parallel.nproc", "2"]


def cli(cwd: Path, *args: str, timeout: int = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_auto_with_a_pin_chooses_trains_and_matches_the_hand_written_layout(tmp_path: Path):
    auto = cli(tmp_path, "train", *TINY, "--parallel.auto", "true", "--parallel.pp", "2", "--train.name", "auto")
    assert auto.returncode == 0, auto.stdout + auto.stderr
    chosen = [line for line in auto.stdout.splitlines() if "parallel.auto chose" in line]
    assert len(chosen) == 1 and "pp=2" in chosen[0] and "predicted" in chosen[0]
    assert "runner-up" in auto.stdout
    run = tmp_path / "runs" / "auto"
    config = json.loads((run / "config.json").read_text()) if (run / "config.json").exists() else None
    rows = records(run)
    assert rows[0]["kind"] == "prediction" and rows[-1]["kind"] == "summary"
    assert rows[-1]["measured_step_s"] > 0 and rows[-1]["predicted_step_s"] > 0
    plan = rows[0]["plan"]
    assert plan["pp"] == 2
    # the same layout written by hand trains to the same losses (auto only chose; it changed nothing else)
    flags = ["--parallel.pp", "2", "--parallel.pp_schedule", plan["schedule"], "--parallel.pp_chunks", str(plan["chunks"]),
             "--parallel.micro_batch", str(plan["micro_batch"] * plan["microbatches"]),
             "--parallel.pp_microbatches", str(plan["microbatches"]), "--parallel.zero_stage", str(plan["zero_stage"]),
             "--parallel.activation_checkpointing", plan["activation_checkpointing"]]
    if plan["pp_split"]:
        flags += ["--parallel.pp_split", ",".join(plan["pp_split"])]
    hand = cli(tmp_path, "train", *TINY, *flags, "--train.name", "hand")
    assert hand.returncode == 0, hand.stdout + hand.stderr
    loss = lambda rs: {r["step"]: r["loss"] for r in rs if "kind" not in r}  # noqa: E731
    assert loss(records(tmp_path / "runs" / "hand")) == pytest.approx(loss(rows), rel=1e-6)
    assert config is None or config["parallel"]["pp"] == 2


def test_auto_refuses_contradicting_pins_before_launch(tmp_path: Path):
    proc = cli(tmp_path, "train", *TINY, "--parallel.auto", "true", "--parallel.tp", "3", "--train.name", "bad")
    assert proc.returncode == 2
    assert "tp" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs" / "bad" / "metrics.jsonl").exists()
