"""``shardwise train``'s non-finite guard end to end: ``train.nonfinite = stop`` fails the job naming the step and
a parameter with the last good checkpoint left ``latest``; ``skip`` drops the step (weights unchanged, every rank
agreeing even when only one rank's loss is NaN) in every layout, and stops after ``train.max_skipped`` in a row.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from shardwise.checkpoint.sharded import Checkpoint

from .test_train import cli

SMALL = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.warmup_steps", "0",
         "--train.log_every", "1"]
K = 2  # the injected step


def records(run_dir: Path) -> dict[int, dict]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r for r in rows if "kind" not in r}  # not the launcher's prediction/summary


def tensors(path: Path) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(path)
    return {k: ckpt.full(k) for k in ckpt.keys()}


def assert_all_finite(run_dir: Path) -> None:
    for path in sorted((run_dir / "checkpoints").glob("step_*")):
        ckpt = Checkpoint(path)
        for key in ckpt.keys():
            t = ckpt.full(key)
            assert not t.is_floating_point() or bool(torch.isfinite(t).all()), f"{path.name}: {key} not finite"


def test_stop_fails_naming_step_and_parameter_and_keeps_last_good_checkpoint(tmp_path):
    proc = cli(tmp_path, "train", *SMALL, "--train.steps", "4", "--train.ckpt_every", "1",
               "--train.keep_checkpoints", "10", "--optimizer.lr", "1e6", "--train.name", "r")
    run = tmp_path / "runs" / "r"
    assert proc.returncode != 0, proc.stdout + proc.stderr
    bad = max(records(run)) + 1  # the step that raised wrote no metrics record
    line = next(l for l in proc.stderr.splitlines() if "NonFiniteError" in l)
    assert f"non-finite loss or gradient at step {bad}:" in line
    assert "first non-finite gradient on this rank: " in line and ".weight" in line
    assert "--resume" in line
    assert all(math.isfinite(r["loss"]) for r in records(run).values())
    latest = Checkpoint(run)
    assert latest.step == bad - 1  # no checkpoint of the bad step, none after it (the final save did not run)
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1] == f"step_{bad - 1:06d}"
    assert_all_finite(run)


def test_skip_on_one_rank_leaves_the_weights_of_the_step_before(tmp_path):
    """dp=2, NaN loss on rank 1 only at step K: the step is skipped (the weights and optimizer state saved at K are
    bitwise those of K-1), marked in metrics.jsonl and the summary, the run finishes, the next step trains.
    (Every other layout: tests/dist/test_nonfinite.py, cheaper in-process.)"""
    proc = cli(tmp_path, "train", *SMALL, "--train.steps", str(K + 1), "--train.ckpt_every", "1",
               "--train.keep_checkpoints", "10", "--train.nonfinite", "skip", "--debug.nonfinite_step", str(K),
               "--debug.nonfinite_rank", "1", "--train.name", "r")
    run = tmp_path / "runs" / "r"
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = records(run)
    assert [s for s, r in rows.items() if r.get("skipped")] == [K]
    assert all(math.isfinite(r["loss"]) for s, r in rows.items() if s != K)
    before, at, after = (tensors(run / "checkpoints" / f"step_{s:06d}") for s in (K - 1, K, K + 1))
    assert before.keys() == at.keys()
    for key in before:
        assert torch.equal(before[key], at[key]), f"{key} changed in the skipped step"
    assert any(k.startswith("model/") for k in at) and any(k.startswith("optim/") for k in at)
    assert any(not torch.equal(at[k], after[k]) for k in at)  # the step after trains again
    assert_all_finite(run)
    assert "skipped 1 non-finite step" in proc.stdout


def test_skip_stops_after_max_skipped_in_a_row(tmp_path):
    proc = cli(tmp_path, "train", *SMALL, "--train.steps", "3", "--train.ckpt_every", "1",
               "--train.keep_checkpoints", "10", "--train.nonfinite", "skip", "--train.max_skipped", "1",
               "--debug.nonfinite_step", "2", "--train.name", "r")
    run = tmp_path / "runs" / "r"
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "1 consecutive non-finite steps skipped (train.max_skipped = 1), the last at step 2" in proc.stderr
    assert Checkpoint(run).step == 1
    assert_all_finite(run)
