"""``shardwise train`` with no batch flag on layouts whose old fixed defaults (global 32, micro 16) did not divide:
the derived defaults (``runtime/config_defaults.py``) train, are recorded in config.json, and a resume in another
layout keeps the run's global batch. ``shardwise verify --train.steps N`` compares N steps. Few steps each."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.runs import cli, losses

SHORT = ["--train.steps", "2", "--optimizer.warmup_steps", "1"]  # length only: no batch flag


def _saved(run: Path) -> dict:
    return json.loads((run / "config.json").read_text())


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("four")
    proc = cli(cwd, "train", "--parallel.nproc", "4", *SHORT, "--train.name", "four", timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / "four"


def test_four_ranks_train_with_the_default_batch(four_ranks):
    assert sorted(losses(four_ranks)) == [1, 2]
    data, parallel = _saved(four_ranks)["data"], _saved(four_ranks)["parallel"]
    # recorded resolved: 16 sequences per data-parallel rank, the batch arithmetic holding
    assert data["global_batch"] == 16 * 4 and parallel["dp"] == 4
    assert parallel["micro_batch"] * parallel["grad_accum"] * parallel["dp"] == data["global_batch"]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    return _small_run(tmp_path_factory.mktemp("small"), [])


def _small_run(cwd: Path, layout: list[str]) -> Path:
    proc = cli(cwd, "train", "--data.global_batch", "4", "--parallel.nproc", "2", *layout, *SHORT,
               "--train.name", "small", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / "small"


@pytest.mark.parametrize("layout", [[], ["--parallel.pp", "2"]], ids=["dp2", "pp2"])
def test_a_small_global_batch_alone_trains(small, tmp_path, layout):
    run = _small_run(tmp_path, layout) if layout else small
    assert sorted(losses(run)) == [1, 2]
    p = _saved(run)["parallel"]
    assert p["micro_batch"] * p["grad_accum"] * p["dp"] == 4
    if layout:  # a pipeline pass of the replica cut into equal micro-batches
        assert p["dp"] == 1 and p["micro_batch"] % p["pp_microbatches"] == 0
    else:
        assert p["dp"] == 2


def test_resume_on_more_ranks_keeps_the_global_batch(small, tmp_path):
    """The saved micro-batch (2) does not fit dp = 4 with the saved global batch (4): it is derived again, at
    most the saved one; the global batch stays the run's (not the default for dp = 4)."""
    run = tmp_path / "small"
    shutil.copytree(small, run)
    proc = cli(tmp_path, "train", "--resume", str(run), "--parallel.nproc", "4", "--train.steps", "3", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saved = _saved(run)
    assert saved["data"]["global_batch"] == 4 and saved["parallel"]["dp"] == 4
    assert saved["parallel"]["micro_batch"] == 1
    assert sorted(losses(run)) == [1, 2, 3]


def test_verify_honours_train_steps(tmp_path):
    proc = cli(tmp_path, "verify", "--train.steps", "3", "--data.global_batch", "4", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: 3 steps agree" in proc.stdout
    proc = cli(tmp_path, "verify", "--train.steps", "3", "--steps", "4")
    assert proc.returncode == 2 and "--steps 4 and --train.steps 3 disagree" in proc.stderr
