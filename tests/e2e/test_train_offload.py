"""``--parallel.offload`` end to end: ZeRO-3 with the optimizer, then the parameters too, in host memory trains to
the very losses of the same run without offload (CPU ranks: host and device are one memory), saves and resumes,
and says in its ledger which bytes the offload placed on the host."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.e2e.runs import cli, losses

FLAGS = ["--preset", "gpt-tiny", "--parallel.nproc", "2", "--parallel.zero_stage", "3", "--data.global_batch", "4",
         "--parallel.micro_batch", "2", "--train.steps", "4", "--train.ckpt_every", "2", "--train.log_every", "1",
         "--optimizer.clip_grad_norm", "0.5"]


def _train(cwd: Path, name: str, *flags: str) -> Path:
    proc = cli(cwd, "train", *FLAGS, "--train.name", name, *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / name


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("offload"), "plain")


def test_offload_trains_saves_and_resumes_like_no_offload(plain, tmp_path):
    run = _train(tmp_path, "off", "--parallel.offload", "params")  # parameters, master weights and state on the host
    assert losses(run) == losses(plain)  # the same arithmetic on the same memory: bit for bit
    book = json.loads((run / "ranks" / "rank00000.json").read_text())["memory_ledger"]
    place = book["placement"]
    assert place["offload"] == "params" and place["host"] > 0 and place["device"] >= 0
    # resume the step-2 checkpoint with the optimizer offloaded only: steps 3-4 repeat the run without offload
    again = tmp_path / "again"
    shutil.copytree(run, again)
    proc = cli(tmp_path, "train", "--resume", str(again / "checkpoints" / "step_000002"), "--parallel.offload",
               "optimizer")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert {s: v for s, v in losses(again).items() if s > 2} == {s: v for s, v in losses(plain).items() if s > 2}
