"""``shardwise train`` with pipeline parallelism (``--parallel.pp``) end to end through the CLI.

References: the single-process run of the same config (same global batch through accumulation), for the
losses and the exported weights; for a resume in the same layout, the uninterrupted run (bit for bit).
SGD with momentum and a large learning rate: a gradient-scale bug (e.g. grad_accum or dp not averaged)
changes SGD's losses visibly, where Adam would normalise a constant factor away; momentum is optimizer state.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.sharded import Checkpoint

# global batch 8 = micro_batch 8 × grad_accum 1 × dp 1 (pp = 2: one pipe.step per step, 4 micro-batches of 2
# sequences), or 2 × 2 × 2 on pp × dp = 2 × 2 (two pipe.step passes per step, each 2 micro-batches of 1 sequence)
FLAGS = ["--data.global_batch", "8", "--parallel.micro_batch", "8", "--optimizer.name", "sgd", "--optimizer.lr", "0.3",
         "--optimizer.warmup_steps", "0", "--optimizer.schedule", "constant", "--train.log_every", "1",
         "--train.steps", "4", "--train.ckpt_every", "2"]


def cli(cwd: Path, *args: str, timeout: int = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "kind" not in r}  # not the launcher's prediction/summary


def train(cwd: Path, name: str, *flags: str) -> Path:
    proc = cli(cwd, "train", *FLAGS, "--train.name", name, *flags)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / name


def assert_close_losses(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    for step in steps:  # another layout sums in another order: equal up to float noise
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got[step], want[step])


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """(the single-process run, the pp = 2 run with stages [wte, blocks.0] | [blocks.1, ln_f]), 4 steps each."""
    cwd = tmp_path_factory.mktemp("pp")
    return train(cwd, "one", "--parallel.nproc", "1"), train(cwd, "pp2", "--parallel.pp", "2",
                                                               "--parallel.pp_split", "blocks.1")


def test_pp2_trains_like_one_process(runs):
    one, pp2 = runs
    want, got = losses(one), losses(pp2)
    assert sorted(got) == [1, 2, 3, 4]
    assert got[4] < got[1] - 0.3  # it learns (so equal losses are not equal by standing still)
    assert_close_losses(got, want, [1, 2, 3, 4])


def test_pp2_checkpoint_holds_each_stage_once_under_the_plain_keys(runs):
    _, pp2 = runs
    ckpt = Checkpoint(pp2)
    assert ckpt.step == 4 and ckpt.index["mesh"] == {"pp": 2, "dp": 1, "tp": 1}
    from safetensors import safe_open

    def keys(rank: int) -> set[str]:
        with safe_open(str(ckpt.path / f"rank{rank:05d}.safetensors"), framework="pt") as f:
            return {k for k in f.keys() if k.startswith("model/")}

    from shardwise.models import GPT, GPTConfig

    plain = set(GPT(GPTConfig()).state_dict()) - {"lm_head.weight"}  # tied: saved once, under wte.weight
    stage0 = {k for k in plain if k.startswith(("wte.", "wpe.", "blocks.0."))}  # the split given on the CLI
    assert keys(0) == {f"model/{k}" for k in stage0}
    assert keys(1) == {f"model/{k}" for k in plain - stage0}
    assert ckpt.state["aliases"] == {"lm_head.weight": "wte.weight"}
    for key, info in ckpt.index["tensors"].items():
        assert len(info["pieces"]) == 1, key  # every tensor written exactly once
    # optimizer state (SGD momentum) of both stages, the tied weight's once
    assert {k for k in ckpt.keys("optim/")} == {f"optim/{k}/momentum_buffer" for k in plain}


def test_pp2_export_equals_the_single_process_weights(runs, tmp_path):
    from safetensors.torch import load_file

    from shardwise.models import GPT, GPTConfig

    one, pp2 = runs
    for run in (one, pp2):
        proc = cli(tmp_path, "export", str(run), "--out", str(tmp_path / f"{run.name}.safetensors"))
        assert proc.returncode == 0, proc.stderr
    got, want = load_file(str(tmp_path / "pp2.safetensors")), load_file(str(tmp_path / "one.safetensors"))
    model = GPT(GPTConfig())
    assert set(got) == set(model.state_dict())
    model.load_state_dict(got)
    torch.testing.assert_close(got["lm_head.weight"], got["wte.weight"], rtol=0, atol=0)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6)
    assert not torch.equal(got["blocks.1.mlp.fc.weight"], GPT(GPTConfig()).state_dict()["blocks.1.mlp.fc.weight"])


def test_pp2_resumes_at_pp1_and_at_pp2(runs, tmp_path):
    one, pp2 = runs
    for name, layout in (("to-pp1", ["--parallel.pp", "1", "--parallel.nproc", "1"]), ("to-pp2", [])):
        run = tmp_path / name
        shutil.copytree(pp2, run)
        proc = cli(tmp_path, "train", "--resume", str(run / "checkpoints" / "step_000002"), *layout)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        got = losses(run)
        assert sorted(got) == [1, 2, 3, 4]
        if layout:  # another layout: the uninterrupted single process's continuation, to float noise
            assert_close_losses(got, losses(one), [3, 4])
            assert Checkpoint(run).index["mesh"] == {"dp": 1, "tp": 1}
        else:  # the same layout: bit for bit (model, momentum, data position and RNG restored). Without
            # accumulation: with grad_accum > 1 the two copies of the tied weight drift apart by float rounding
            # inside sw.pipeline (reported to the lead), so the one saved copy differs from the other by ulps.
            assert got == losses(pp2)


def test_pp2_times_dp2_on_4_ranks_trains_like_one_process(runs, tmp_path):
    one, _ = runs
    run = train(tmp_path, "pp2dp2", "--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.pp_schedule", "zb-h1",
                "--parallel.micro_batch", "2", "--train.steps", "3", "--train.ckpt_every", "0")  # grad_accum 2
    assert_close_losses(losses(run), losses(one), [1, 2, 3])
    assert Checkpoint(run).index["mesh"] == {"pp": 2, "dp": 2, "tp": 1}


@pytest.mark.parametrize("flags,expected", [
    (["--parallel.pp", "3"], "parallel.pp = 3 processes per replica do not divide parallel.nproc = 2 (parallel.dp "
                             "is inferred as nproc / that); set --parallel.nproc 3 or lower pp"),
    (["--parallel.pp", "2", "--parallel.zero_stage", "3", "--parallel.offload", "params"],
     "parallel.offload = params with parallel.pp = 2 is not supported"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "pipedream"], "unknown parallel.pp_schedule 'pipedream'"),
    (["--parallel.pp", "2", "--parallel.pp_microbatches", "3"], "parallel.micro_batch = 8 must be divisible by "
                                                                "parallel.pp_microbatches = 3"),
    (["--parallel.pp", "2", "--parallel.pp_split", "blocks.7"], "'blocks.7' names no module of the model"),
    (["--parallel.pp", "2", "--parallel.pp_schedule", "interleaved", "--parallel.pp_chunks", "3"],
     "the model has 4 pipeline units"),
    (["--parallel.pp_split", "blocks.1", "--parallel.nproc", "1"],
     "parallel.pp_split = ('blocks.1',) only applies to pipeline parallelism"),
], ids=["world", "offload", "schedule", "microbatches", "split", "stages", "pp1-split"])
def test_bad_pipeline_configs_are_rejected_before_any_rank_starts(tmp_path, monkeypatch, capsys, flags, expected):
    from shardwise import cli as cli_module
    from shardwise.runtime import job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "run_local", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli_module.main(["train", *FLAGS, *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err, err


# -- hybrids: tp inside the stages, activation checkpointing, ZeRO-1 over dp ------------------------------------

def full_states(ckpt: Checkpoint, prefix: str) -> dict[str, torch.Tensor]:
    """Every tensor under ``prefix`` assembled from its pieces (``full`` raises unless they cover it exactly once)."""
    return {k: ckpt.full(k) for k in ckpt.keys(prefix)}


def test_pp2_times_tp2_trains_like_one_process_and_its_checkpoint_changes_layout(runs, tmp_path):
    one, _ = runs
    run = train(tmp_path, "pptp", "--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.tp", "2")
    assert_close_losses(losses(run), losses(one), [1, 2, 3, 4])
    ckpt = Checkpoint(run)
    assert ckpt.index["mesh"] == {"pp": 2, "dp": 1, "tp": 2}
    qkv = ckpt.index["tensors"]["model/blocks.1.attn.qkv.weight"]  # head-split over tp, on the last stage only
    assert (qkv["sbp"], qkv["axes"]) == ("B,S(1)", ["dp", "tp"])
    assert sorted(p["file"] for p in qkv["pieces"]) == ["rank00002.safetensors", "rank00003.safetensors"]
    # the whole model and its momentum, each element once, equal to the single process's (float noise)
    want = Checkpoint(one)
    for prefix in ("model/", "optim/"):
        got = full_states(ckpt, prefix)
        assert set(got) == set(want.keys(prefix))
        for key, value in got.items():
            torch.testing.assert_close(value, want.full(key), rtol=1e-4, atol=1e-6)
    # pp × tp step 2 → one process, and the single process's step 2 → pp × tp: both continue like `one`
    back, there = tmp_path / "back", tmp_path / "there"
    shutil.copytree(run, back)
    shutil.copytree(one, there)
    for target, layout in ((back, ["--parallel.pp", "1", "--parallel.tp", "1", "--parallel.nproc", "1"]),
                           (there, ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.nproc", "4"])):
        proc = cli(tmp_path, "train", "--resume", str(target / "checkpoints" / "step_000002"), *layout)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert_close_losses(losses(target), losses(one), [3, 4])
    assert Checkpoint(back).index["mesh"] == {"dp": 1, "tp": 1}
    assert Checkpoint(there).index["mesh"] == {"pp": 2, "dp": 1, "tp": 2}


@pytest.mark.parametrize("mode, schedule", [("true", "zb-h1"), ("selective", "1f1b")])
def test_pp2_with_activation_checkpointing_trains_like_one_process(runs, tmp_path, mode, schedule):
    one, _ = runs  # zb-h1: checkpointed units recomputed for B, weight gradients from W
    run = train(tmp_path, "ppck", "--parallel.pp", "2", "--parallel.activation_checkpointing", mode,
                "--parallel.pp_schedule", schedule, "--train.steps", "3", "--train.ckpt_every", "0")
    assert_close_losses(losses(run), losses(one), [1, 2, 3])


def test_selective_checkpointing_under_zero3_and_tp_trains_like_one_process(runs, tmp_path):
    one, _ = runs  # ZeRO-3 re-gathers each unit for its backward, where the recomputation runs; tp's collectives rerun
    run = train(tmp_path, "selz3", "--parallel.nproc", "4", "--parallel.tp", "2", "--parallel.zero_stage", "3",
                "--parallel.micro_batch", "4", "--parallel.activation_checkpointing", "selective",
                "--train.steps", "2", "--train.ckpt_every", "0")
    assert_close_losses(losses(run), losses(one), [1, 2])


def test_pp2_times_dp2_zero1_trains_like_one_process_and_resumes_at_pp1(runs, tmp_path):
    one, _ = runs
    run = train(tmp_path, "ppz", "--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.zero_stage", "1",
                "--parallel.micro_batch", "2")  # two pipe.step passes per step (grad_accum 2), accumulated under ZeRO-1
    assert_close_losses(losses(run), losses(one), [1, 2, 3, 4])
    ckpt = Checkpoint(run)
    flat = {k: v for k, v in ckpt.index["tensors"].items() if k.startswith("zero/")}
    assert not ckpt.keys("optim/") and {k.split("/")[1].split(".")[0] for k in flat} == {"pp0", "pp1"}
    for key, info in flat.items():  # S(0) over dp, written by both dp ranks of the owning pp coordinate
        assert (info["sbp"], info["axes"], len(info["pieces"])) == ("S(0),B", ["dp", "tp"], 2), key
    # the flat shards, read back per parameter, are the single process's momentum (float noise)
    from shardwise.checkpoint.zero_layout import param_state

    names, fetch = param_state(ckpt)
    want = Checkpoint(one)
    assert {f"optim/{n}/{s}" for n, states in names.items() for s in states} == set(want.keys("optim/"))
    for name in names:
        torch.testing.assert_close(fetch(name, "momentum_buffer"), want.full(f"optim/{name}/momentum_buffer"),
                                   rtol=1e-4, atol=1e-6)
    back = tmp_path / "back"
    shutil.copytree(run, back)
    proc = cli(tmp_path, "train", "--resume", str(back / "checkpoints" / "step_000002"), "--parallel.pp", "1",
               "--parallel.zero_stage", "0", "--parallel.nproc", "1", "--parallel.micro_batch", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_close_losses(losses(back), losses(one), [3, 4])


def test_pp2_times_dp2_zero3_trains_like_one_process_saves_shards_and_resumes(runs, tmp_path):
    """ZeRO-3 inside the pipeline: equal to one process; the checkpoint holds every parameter whole under its plain
    key, written as ranges of the dp shards; resuming in the same layout (into the shards) continues the run."""
    one, _ = runs
    run = train(tmp_path, "ppz3", "--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.zero_stage", "3",
                "--parallel.micro_batch", "2", "--parallel.pp_schedule", "zb-h1")
    assert_close_losses(losses(run), losses(one), [1, 2, 3, 4])
    ckpt, want = Checkpoint(run), Checkpoint(one)
    assert set(ckpt.keys("model/")) == set(want.keys("model/"))
    for key in ckpt.keys("model/"):  # flattened ranges of the dp shards, S(0) over dp, nothing gathered
        info = ckpt.index["tensors"][key]
        assert (info["sbp"], info["axes"], len(info["view_shape"])) == ("S(0),B", ["dp", "tp"], 1), (key, info)
    big = ckpt.index["tensors"]["model/wte.weight"]["pieces"]
    assert len({p["file"] for p in big}) == 2, big  # the tied embedding: both dp ranks of pp coordinate 0
    for key in want.keys("model/"):
        torch.testing.assert_close(ckpt.full(key), want.full(key), rtol=1e-4, atol=1e-6)
    back = tmp_path / "back"
    shutil.copytree(run, back)
    proc = cli(tmp_path, "train", "--resume", str(back / "checkpoints" / "step_000002"), timeout=200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_close_losses(losses(back), losses(one), [3, 4])
