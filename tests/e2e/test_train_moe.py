"""``shardwise train`` / ``verify`` / ``export`` with a mixture of experts split over ``--parallel.ep`` (the runtime's
numbers against one device at relative 1e-5 are in tests/dist/test_moe_runtime.py; here the commands end to end).

One 4-step run at ep 2 on 2 processes, checkpointed at step 2; that checkpoint resumed at ep 1 (the experts
whole on every rank) repeats steps 3-4; both final checkpoints export to the same full tensors, the experts
gathered to (E, ...) from their ep pieces; each step's metrics record carries the routing statistics;
``shardwise verify --parallel.ep 2`` agrees with one process. SGD: the weights move in proportion to the
gradients, so an expert gradient averaged wrongly would show in the exported weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardwise.cli import main as cli_main
from tests.e2e.runs import cli, losses

MOE = ["--model.n_experts", "4", "--model.top_k", "2", "--model.moe_ffn", "32", "--model.n_layer", "2",
       "--model.n_shared_experts", "1", "--model.moe_aux_loss_coef", "0.05"]
FLAGS = [*MOE, "--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.name", "sgd",
         "--optimizer.lr", "0.3", "--optimizer.warmup_steps", "0", "--optimizer.schedule", "constant"]
E, F, H = 4, 32, 64  # experts, expert width (moe_ffn), hidden size of the default tiny GPT


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("moe")
    proc = cli(cwd, "train", *FLAGS, "--parallel.ep", "2", "--parallel.nproc", "2", "--train.steps", "4",
               "--train.ckpt_every", "2", "--train.keep_checkpoints", "3", "--train.name", "ep2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / "ep2"


def _export(run: Path, out: Path) -> dict[str, torch.Tensor]:
    assert cli_main(["export", str(run), "--out", str(out)]) == 0
    return load_file(str(out))


def test_metrics_carry_routing_statistics(ep2_run):
    rows = [json.loads(line) for line in (ep2_run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "kind" not in r and "loss" in r and "step" in r and "val_loss" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        assert sorted(r["moe"]) == ["blocks.0.mlp", "blocks.1.mlp"], r.get("moe")
        for stats in r["moe"].values():
            assert set(stats) == {"aux", "min", "max", "cv", "dropped", "starved"}
            assert stats["dropped"] == 0 and 0 <= stats["min"] <= stats["max"] and stats["aux"] >= 1.0 - 1e-6
            assert (stats["starved"] > 0) == (stats["min"] == 0), stats


def test_resume_at_ep1_and_export_gathers_the_experts(ep2_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ep2_run, run)
    proc = cli(tmp_path, "train", "--resume", str(run / "checkpoints" / "step_000002"), "--parallel.ep", "1",
               "--parallel.nproc", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want, got = losses(ep2_run), losses(run)
    for step in (3, 4):
        assert got[step] == pytest.approx(want[step], rel=1e-5), (step, got, want)
    index = json.loads((ep2_run / "checkpoints" / "step_000004" / "index.json").read_text())
    piece = index["tensors"]["model/blocks.0.mlp.experts.gate_up_proj"]
    assert piece["axes"] == ["edp", "ep", "tp"] and piece["sbp"] == "B,S(0),B", piece
    a, b = _export(ep2_run, tmp_path / "ep2.safetensors"), _export(run, tmp_path / "ep1.safetensors")
    assert sorted(a) == sorted(b)
    assert tuple(a["blocks.0.mlp.experts.gate_up_proj"].shape) == (E, 2 * F, H)
    assert tuple(a["blocks.1.mlp.experts.down_proj"].shape) == (E, H, F)
    for key in a:
        assert torch.allclose(a[key], b[key], rtol=1e-4, atol=1e-6), key


def test_verify_takes_parallel_ep(tmp_path):
    proc = cli(tmp_path, "verify", *FLAGS, "--parallel.ep", "2", "--parallel.nproc", "2", "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ep=2" in proc.stdout and "OK: 2 steps agree" in proc.stdout, proc.stdout


def test_hf_export_of_a_gpt_with_experts_is_refused_in_one_line(ep2_run, tmp_path, capsys):
    assert cli_main(["export", str(ep2_run), "--format", "hf", "--out", str(tmp_path / "hf")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.n_experts = 4" in err[0] and "--format safetensors" in err[0], err
    assert not (tmp_path / "hf").exists()
