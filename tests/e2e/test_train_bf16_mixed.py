"""``shardwise train --train.precision bf16-mixed``: bf16 weights and gradients, fp32 master weights and optimizer state
in ZeRO's shards (``sw.MixedPrecision``), under ZeRO-2 over dp and ZeRO-1 inside a pipeline.

References: the fp32 single-process run of the same config (bf16 rounding: within 2e-2 relative per step); for a
resume in the same layout, the uninterrupted bf16-mixed run (the masters and the optimizer state are restored,
the bf16 weights are their cast: bit for bit).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from shardwise.checkpoint.sharded import Checkpoint
from tests.e2e.test_train_pp import cli, losses, train

MIXED = ["--train.precision", "bf16-mixed"]


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("mixed")
    return cwd, train(cwd, "one", "--parallel.nproc", "1")


@pytest.mark.parametrize("name,flags", [
    ("zero2", ["--parallel.nproc", "2", "--parallel.zero_stage", "2", "--parallel.micro_batch", "4"]),
    ("pp-zero1", ["--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.zero_stage", "1",
                  "--parallel.micro_batch", "2"]),
])
def test_bf16_mixed_trains_near_fp32_keeps_fp32_masters_and_resumes_exactly(one, tmp_path, name, flags):
    cwd, ref = one
    run = train(tmp_path, name, *MIXED, *flags)
    got, want = losses(run), losses(ref)
    for step in (1, 2, 3, 4):
        assert got[step] == pytest.approx(want[step], rel=2e-2), (step, got[step], want[step])
    assert got[4] < got[1]
    ckpt = Checkpoint(run)
    dtypes = {ckpt.index["tensors"][k]["dtype"] for k in ckpt.keys("model/")}
    assert dtypes == {"float32"}, dtypes  # the masters, not the bf16 compute weights
    for key in ckpt.keys("model/"):  # fp32 weights near the fp32 run's after 4 steps
        torch.testing.assert_close(ckpt.full(key), Checkpoint(ref).full(key), rtol=0, atol=2e-2)
    back = tmp_path / "back"
    shutil.copytree(run, back)
    nproc = flags[flags.index("--parallel.nproc") + 1]
    proc = cli(tmp_path, "train", "--resume", str(back / "checkpoints" / "step_000002"), "--parallel.nproc", nproc,
               timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = losses(back)
    assert [resumed[s] for s in (3, 4)] == [got[s] for s in (3, 4)], (resumed, got)


def test_bf16_mixed_without_zero_is_refused(tmp_path):
    proc = cli(tmp_path, "train", *MIXED, "--parallel.nproc", "1", "--train.steps", "1")
    assert proc.returncode != 0
    assert "train.precision = bf16-mixed keeps fp32 master weights in ZeRO's shards, but parallel.zero_stage = 0; " \
           "use --parallel.zero_stage 1, 2 or 3" in proc.stderr, proc.stderr
