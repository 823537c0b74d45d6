"""``shardwise train --parallel.tp 2 --parallel.replicate wte``: the planner's module pin, run. The embedding
and its tied head stay whole on every tp rank (the loss is the plain cross-entropy over whole logits), the
blocks keep Megatron's split; it trains to one process's losses, and its checkpoints reshard to and from the
default vocabulary-parallel layout (a resumed run continues with the uninterrupted run's losses, rel 1e-4)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardwise.checkpoint.sharded import Checkpoint
from tests.e2e.test_train import cli, losses
from tests.e2e.test_train_zero_tp import STEPS, assert_close_losses, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(tp 2 with the embedding and head whole, one process): 3 steps each, a checkpoint after every step."""
    cwd = tmp_path_factory.mktemp("replicate")
    return (train(cwd, "rep", "--parallel.nproc", "2", "--parallel.tp", "2", "--parallel.replicate", "wte"),
            train(cwd, "one", "--parallel.nproc", "1"))


def test_replicated_embedding_trains_like_one_process(runs):
    rep, one = runs
    assert_close_losses(losses(rep), losses(one), STEPS)
    tensors = Checkpoint(rep).index["tensors"]
    assert Checkpoint(rep).index["mesh"] == {"dp": 1, "tp": 2}
    assert tensors["model/wte.weight"]["sbp"] == "B,B"  # whole on both tp ranks (the head is the same weight)
    assert tensors["model/blocks.0.attn.qkv.weight"]["sbp"].startswith("B,S(")  # the blocks still split over tp


@pytest.mark.parametrize("which,layout", [
    (0, ["--parallel.tp", "1", "--parallel.nproc", "1"]),
    (1, ["--parallel.tp", "2", "--parallel.nproc", "2", "--parallel.replicate", "wte"]),
], ids=["replicated-to-one", "one-to-replicated"])
def test_replicated_layout_reshards(runs, tmp_path, which, layout):
    src = runs[which]
    run = tmp_path / "run"
    shutil.copytree(src, run)
    proc = cli(tmp_path, "train", "--resume", str(run / "checkpoints" / "step_000001"), *layout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_close_losses(losses(run), losses(src), [2, 3])
