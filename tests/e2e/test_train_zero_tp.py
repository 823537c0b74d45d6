"""``shardwise train`` with ZeRO over dp and tensor parallelism inside (``--parallel.tp 2 --parallel.zero_stage N``)
end to end through the CLI: its checkpoints reshard to and from other layouts.

References, as in test_train.py: a resumed run must continue with the losses of the uninterrupted run it was cut
from (another layout sums in another order: equal up to float noise, rel 1e-4), and the two uninterrupted runs
of different layouts (dp 2 × tp 2 ZeRO-3, dp 4 ZeRO-1) agree with each other the same way.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.checkpoint.sharded import Checkpoint
from shardwise.checkpoint.zero_layout import param_state
from shardwise.cli import main as cli_main
from tests.e2e.test_train import cli, losses

FLAGS = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.warmup_steps", "2",
         "--train.log_every", "1", "--train.steps", "3", "--train.ckpt_every", "1", "--train.keep_checkpoints", "3"]
STEPS = [1, 2, 3]


def train(cwd: Path, name: str, *flags: str) -> Path:
    proc = cli(cwd, "train", *FLAGS, "--train.name", name, *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / name


def assert_close_losses(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    assert sorted(got) == STEPS
    for step in steps:
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got[step], want[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(dp 2 × tp 2 with ZeRO-3, dp 4 with ZeRO-1): 3 steps each on 4 ranks, a checkpoint after every step."""
    cwd = tmp_path_factory.mktemp("zero-tp")
    return (train(cwd, "z3tp", "--parallel.nproc", "4", "--parallel.tp", "2", "--parallel.zero_stage", "3"),
            train(cwd, "z1dp", "--parallel.nproc", "4", "--parallel.zero_stage", "1"))


def test_zero3_with_tp_trains_like_dp4_and_saves_tp_shards(runs):
    z3tp, z1dp = runs
    assert_close_losses(losses(z3tp), losses(z1dp), STEPS)
    ckpt, other = Checkpoint(z3tp), Checkpoint(z1dp)
    assert ckpt.index["mesh"] == {"dp": 2, "tp": 2}
    assert ckpt.index["tensors"]["model/blocks.0.attn.qkv.weight"]["sbp"] == "B,S(1)"  # the tp blocks
    # ... each written as its dp ranks' own ranges of it (nothing gathered): every rank writes parameters
    pieces = [p for k, v in ckpt.index["tensors"].items() if k.startswith("model/") for p in v["pieces"]]
    assert all("range" in p for p in pieces), pieces
    assert {p["file"] for p in pieces} == {f"rank{r:05d}.safetensors" for r in range(4)}, pieces
    flat = {k: v for k, v in ckpt.index["tensors"].items() if k.startswith("zero/") and k.endswith("/exp_avg")}
    assert flat and {k.split("/")[1].rpartition(".")[2] for k in flat} == {"tp0", "tp1"}, sorted(flat)
    assert all((v["sbp"], v["axes"], len(v["pieces"])) == ("S(0)", ["dp"], 2) for v in flat.values()), flat
    # the flat shards of both tp coordinates, read back per parameter = the dp 4 run's (untensor-parallel) state
    names, fetch = param_state(ckpt)
    _, want = param_state(other)
    assert set(names) == set(param_state(other)[0])
    for name in ("blocks.0.attn.qkv.weight", "blocks.1.mlp.proj.weight", "ln_f.bias", "wte.weight"):
        torch.testing.assert_close(fetch(name, "exp_avg_sq"), want(name, "exp_avg_sq"), rtol=1e-3, atol=1e-9)
    torch.testing.assert_close(ckpt.full("model/blocks.1.mlp.fc.weight"), other.full("model/blocks.1.mlp.fc.weight"),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("layout,mesh", [
    (["--parallel.tp", "1", "--parallel.nproc", "4"], {"dp": 4, "tp": 1}),                           # ZeRO-3 kept
    (["--parallel.zero_stage", "0", "--parallel.nproc", "2"], {"dp": 1, "tp": 2}),
], ids=["to-dp4-zero3", "to-tp2-zero0"])
def test_zero3_with_tp_resumes_in_other_layouts(runs, tmp_path, layout, mesh):
    z3tp, _ = runs
    run = tmp_path / "run"
    shutil.copytree(z3tp, run)
    proc = cli(tmp_path, "train", "--resume", str(run / "checkpoints" / "step_000001"), *layout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_close_losses(losses(run), losses(z3tp), [2, 3])
    assert Checkpoint(run).step == 3 and Checkpoint(run).index["mesh"] == mesh


def test_zero3_with_tp_exports_like_dp4(runs, tmp_path, capsys):
    """``shardwise export`` reads the ranged tp blocks into the plain model's full tensors: the dp 4 run's. Relative
    to each tensor's largest value: the qkv biases start at 0 and AdamW's m/sqrt(v) of their tiny gradients carries
    the layouts' summation-order noise to ~1e-3 of their size (a misplaced range would be off by the values)."""
    exported = []
    for run in runs:
        out = tmp_path / f"{run.name}.safetensors"
        assert cli_main(["export", str(run), "--out", str(out)]) == 0, capsys.readouterr().err
        exported.append(load_file(str(out)))
    got, want = exported
    assert sorted(got) == sorted(want) and "lm_head.weight" in got
    for key, value in want.items():
        err = float((got[key] - value).abs().max() / value.abs().max().clamp_min(1e-12))
        assert got[key].shape == value.shape and err < 2e-3, (key, err)


def test_dp4_zero1_resumes_as_zero2_with_tp(runs, tmp_path):
    _, z1dp = runs
    run = tmp_path / "run"
    shutil.copytree(z1dp, run)
    proc = cli(tmp_path, "train", "--resume", str(run / "checkpoints" / "step_000001"), "--parallel.tp", "2",
               "--parallel.zero_stage", "2", "--parallel.nproc", "4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_close_losses(losses(run), losses(z1dp), [2, 3])
    saved = Checkpoint(run)
    assert saved.index["mesh"] == {"dp": 2, "tp": 2} and saved.state.get("zero_groups_per_rank") is True
    assert any(k.endswith(".tp1/exp_avg") for k in saved.keys("zero/"))
