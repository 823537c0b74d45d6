"""``shardwise train`` / ``verify`` / ``export`` / ``plot`` end to end through the CLI (tiny model, a few steps).

The reference for every distributed run is the single-process run of the same config (``shardwise verify``
launches it), or an uninterrupted run of the same layout (resume must reproduce its losses bit for bit).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.sharded import Checkpoint
from tests.e2e.runs import resume_in_layout

TINY = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.warmup_steps", "2",
        "--train.log_every", "1", "--train.steps", "6", "--train.ckpt_every", "3"]


def cli(cwd: Path, *args: str, timeout: int = 150) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "kind" not in r}  # not the launcher's prediction/summary


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    """An uninterrupted dp=2 run of 6 steps with checkpoints at steps 3 and 6."""
    cwd = tmp_path_factory.mktemp("baseline")
    proc = cli(cwd, "train", *TINY, "--train.name", "base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / "base"


def test_dp2_run_writes_metrics_checkpoints_summary(baseline):
    got = losses(baseline)
    assert sorted(got) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(v) for v in got.values())
    assert got[1] == pytest.approx(math.log(256), abs=0.1)  # uniform prediction over bytes at init
    assert got[6] < got[1] - 0.3  # it learns
    ckpt = Checkpoint(baseline)
    assert ckpt.step == 6 and ckpt.index["mesh"] == {"dp": 2, "tp": 1}
    assert sorted(p.name for p in (baseline / "checkpoints").iterdir()) == ["latest", "step_000003", "step_000006"]
    assert ckpt.index["tensors"]["model/wte.weight"]["sbp"] == "B,B"
    assert len(ckpt.index["tensors"]["model/wte.weight"]["pieces"]) == 1  # a replica is written once
    # the launcher's prediction before the steps, predicted next to measured after them
    records = [json.loads(line) for line in (baseline / "metrics.jsonl").read_text().splitlines()]
    first, last = records[0], records[-1]
    assert first["kind"] == "prediction" and first["step"] == 0 and first["step_time_s"] > 0
    assert last["kind"] == "summary" and last["step"] == 6 and last["predicted_step_s"] == first["step_time_s"]
    assert last["measured_step_s"] > 0 and len(last["measured_model_state_bytes"]) == 2
    for measured in last["measured_model_state_bytes"]:  # params + grads + AdamW m, v: the planner's 16 B each
        assert measured == pytest.approx(last["predicted_model_state_bytes"], rel=0.01)
    # the whole process's peak (building and loading included) next to the bare runtime each rank started from
    assert first["construction_bytes"] == last["predicted_construction_bytes"] > 0
    assert len(last["measured_process_peak_bytes"]) == len(last["bare_runtime_bytes"]) == 2
    for peak, bare in zip(last["measured_process_peak_bytes"], last["bare_runtime_bytes"]):
        assert 0 <= bare <= peak and peak > 0  # a GPU's allocator starts empty: 0 there


def test_export_writes_the_plain_models_keys(baseline, tmp_path):
    from safetensors.torch import load_file

    from shardwise.models import GPT, GPTConfig

    proc = cli(tmp_path, "export", str(baseline), "--out", str(tmp_path / "m.safetensors"))
    assert proc.returncode == 0, proc.stderr
    exported = load_file(str(tmp_path / "m.safetensors"))
    model = GPT(GPTConfig())
    assert set(exported) == set(model.state_dict())
    model.load_state_dict(exported)
    torch.testing.assert_close(exported["lm_head.weight"], exported["wte.weight"], rtol=0, atol=0)
    # The step-6 weights are not the initial ones (the export is of the trained model).
    assert not torch.equal(exported["blocks.0.mlp.fc.weight"], GPT(GPTConfig()).state_dict()["blocks.0.mlp.fc.weight"])


def test_plot_writes_pngs(baseline, tmp_path):
    pytest.importorskip("matplotlib")
    proc = cli(tmp_path, "plot", str(baseline), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for name in ("loss.png", "throughput.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_crash_during_save_leaves_the_last_checkpoint_loadable(baseline, tmp_path):
    proc = cli(tmp_path, "train", *TINY, "--train.name", "base", "--debug.crash_in_save", "6")
    assert proc.returncode != 0
    assert "injected crash" in proc.stderr
    run = tmp_path / "runs" / "base"
    assert (run / "checkpoints" / ".tmp-step_000006").is_dir()  # the half-published save
    ckpt = Checkpoint(run)
    assert ckpt.step == 3
    assert ckpt.full("model/wte.weight").shape == (256, 64)
    proc = cli(tmp_path, "train", "--resume", str(run))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Checkpoint(run).step == 6
    assert losses(run) == losses(baseline)


@pytest.mark.parametrize("layout", [["--parallel.nproc", "1"], ["--parallel.tp", "2"], ["--parallel.zero_stage", "3"]],
                         ids=["world-2-to-1", "dp2-to-tp2", "dp2-to-zero3"])
def test_reshard_on_load(baseline, tmp_path, layout):
    run = resume_in_layout(baseline, tmp_path, layout)
    saved = Checkpoint(run)
    assert saved.step == 6 and saved.index["mesh"] != {"dp": 2, "tp": 1} or layout[0].endswith("zero_stage")
    torch.testing.assert_close(saved.full("model/blocks.0.attn.qkv.weight"),
                               Checkpoint(baseline).full("model/blocks.0.attn.qkv.weight"), rtol=1e-3, atol=1e-5)
    if "--parallel.zero_stage" in layout:  # and back: ZeRO's flat optimizer shards → one plain process
        from shardwise.checkpoint.zero_layout import param_state

        assert "zero/0/exp_avg" in saved.index["tensors"]
        _, fetch = param_state(saved)  # per-parameter view of the flat shards = the dp=2 run's Adam state
        for name in ("blocks.1.mlp.fc.weight", "ln_f.bias", "wte.weight"):
            torch.testing.assert_close(fetch(name, "exp_avg_sq"), Checkpoint(baseline).full(f"optim/{name}/exp_avg_sq"),
                                       rtol=1e-3, atol=1e-9)
        proc = cli(tmp_path, "train", "--resume", str(run), "--parallel.zero_stage", "0", "--parallel.nproc", "1",
                   "--train.steps", "7")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert abs(losses(run)[7] - losses(baseline)[6]) < 0.5 and Checkpoint(run).index["mesh"] == {"dp": 1, "tp": 1}


def test_shared_memory_all_reduce_trains_like_gloo(baseline, tmp_path):
    # steps 4-6 again from the step-3 checkpoint with the gradients all-reduced through shared memory: two
    # replicas' average is the same float sum whichever transport adds them, so the losses match the gloo run
    run = tmp_path / "run"
    shutil.copytree(baseline, run)
    proc = cli(tmp_path, "train", "--resume", str(run / "checkpoints" / "step_000003"),
               "--parallel.algorithm", "shm")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    want, got = losses(baseline), losses(run)
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=1e-6), (step, got[step], want[step])


@pytest.mark.parametrize("flags,expected", [
    (["--parallel.tp", "3"], "parallel.tp = 3 must divide model.n_head = 2"),
    (["--parallel.dp", "3"], "must equal the number of processes parallel.nproc = 2"),
    (["--data.global_batch", "10", "--parallel.micro_batch", "4"], "global_batch=10 is not a multiple"),
    (["--parallel.pp", "2", "--parallel.zero_stage", "1", "--parallel.offload", "optimizer"],
     "parallel.offload = optimizer with parallel.pp = 2 is not supported"),
    (["--model.n_embd", "65"], "model.n_embd (65) must be divisible by n_head (2)"),
    (["--train.steps", "0"], "train.steps = 0 must be >= 1"),
    (["--parallel.tp", "two"], "parallel.tp must be a int, got 'two'"),
    (["--optimizer.name", "lamb"], "optimizer.name = 'lamb' is not allowed"),
    (["--data", "missing.txt"], "missing.txt' does not exist; pass a text file"),
    (["--config", "missing.toml"], "config file 'missing.toml' does not exist"),
], ids=["tp-heads", "world", "batch", "pp-offload", "model", "steps", "type", "choice", "data", "toml"])
def test_bad_configs_are_rejected_before_any_rank_starts(tmp_path, monkeypatch, capsys, flags, expected):
    from shardwise import cli as cli_module
    from shardwise.runtime import job

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(job, "run_local", lambda *a, **k: pytest.fail("a rank was started"))
    assert cli_module.main(["train", *flags]) == 2
    err = capsys.readouterr().err
    assert expected in err, err


def test_fresh_run_refuses_to_clobber_checkpoints(baseline, monkeypatch, capsys):
    from shardwise import cli as cli_module

    monkeypatch.chdir(baseline.parent.parent)
    assert cli_module.main(["train", "--train.name", "base"]) == 2
    assert "already holds checkpoints; continue it with --resume" in capsys.readouterr().err
