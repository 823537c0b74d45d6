"""``shardwise train --parallel.cp N`` end to end (context parallelism: ring attention, each rank two chunks of
every sequence): ``shardwise verify`` equal to one process alone and composed with tp + sequence parallelism (the
Llama family), pp, ZeRO-3 and activation checkpointing; the validation loss of a cp run equals one process's and
plain torch's cross-entropy of the final weights; loss-masked (SFT) data trains to one process's losses;
checkpoints resume across cp sizes (cp 2 → one process); ``--parallel.auto`` with a cp pin trains.

References: one process (``verify``, or an ``--parallel.nproc 1`` run), or the uninterrupted run a resumed run
must continue (another layout sums in another order: equal up to float noise).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.runs import cli, losses, resume_in_layout

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
LLAMA = str(EXAMPLES / "tiny-llama.json")
SMALL = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--model.block_size", "32"]
SGD = ["--optimizer.name", "sgd", "--optimizer.lr", "0.3", "--optimizer.warmup_steps", "0"]
"""SGD with a large learning rate shows gradient-scale bugs (Adam would normalise a constant factor away)."""


def verify(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``shardwise verify --steps 3`` on a tiny model."""
    return cli(cwd, "verify", "--steps", "3", *SMALL, *args)


@pytest.mark.parametrize("args, mesh", [
    ([*SGD, "--parallel.nproc", "4", "--parallel.cp", "2", "--parallel.tp", "2", "--model.hf_config", LLAMA,
      "--parallel.sequence_parallel", "true"], "4 process(es), dp=1 × cp=2 × tp=2"),
    ([*SGD, "--parallel.nproc", "4", "--parallel.cp", "2", "--parallel.pp", "2", "--model.n_layer", "2"],
     "4 process(es), pp=2 × dp=1 × cp=2 × tp=1"),
    ([*SGD, "--parallel.nproc", "4", "--parallel.cp", "2", "--parallel.zero_stage", "3", "--model.n_layer", "2",
      "--parallel.activation_checkpointing", "true"], "4 process(es), dp=2 × cp=2 × tp=1"),
], ids=["cp2-tp2-sp-llama", "pp2-cp2", "cp2-zero3-dp2-checkpointing"])
# (cp 4: the ring on 4 ranks is tests/dist/test_ring_attention.py; its chunks, tests/unit/test_context_split.py)
def test_verify_equals_one_process(tmp_path: Path, args: list[str], mesh: str):
    """The composed layouts, with SGD at a large learning rate, which shows gradient-scale bugs (cp 2 alone, with
    the default AdamW, is compared with one process by the validation test below)."""
    proc = verify(tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"layout: {mesh}" in proc.stdout, proc.stdout
    assert "OK: 3 steps agree" in proc.stdout and "DIFFERS" not in proc.stdout


# -- a prepared dataset: validation and loss-masked data (data, sft_one: the session fixtures of tests/e2e/conftest.py,
# shared with test_train_data: its datasets and its one-process run on the loss-masked one)

from tests.e2e.prepared_runs import SMALL as DATA_SMALL  # noqa: E402
from tests.e2e.prepared_runs import evals as _evals, reference_val_loss as _reference_val_loss, train_run  # noqa: E402


def test_validation_loss_with_cp_equals_plain_torch(data: Path):
    """A cp 2 run's validation loss is plain torch's cross-entropy of its final weights over the whole validation
    sequences (its training losses against one process: the loss-masked test below, with the default AdamW)."""
    proc = cli(data, "train", "--data.path", "ds", *DATA_SMALL, "--parallel.nproc", "2", "--parallel.cp", "2",
               "--train.name", "vcp-cp2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "mesh dp=1 × cp=2 × tp=1" in proc.stdout
    run = data / "runs" / "vcp-cp2"
    cp_evals = _evals(run)
    assert [e["step"] for e in cp_evals] == [2, 4]
    assert cp_evals[-1]["val_loss"] == pytest.approx(_reference_val_loss(run, data / "ds"), rel=1e-5)
    assert json.loads((run / "config.json").read_text())["parallel"]["cp"] == 2
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "prediction" and rows[0]["plan"]["cp"] == 2  # metrics.jsonl names the layout
    assert rows[-1]["kind"] == "summary" and rows[-1]["final_val_loss"] == cp_evals[-1]["val_loss"]
    from shardwise.cli.plot import plot_run

    assert (data / "cp-plots" / "loss.png") in plot_run(run, data / "cp-plots")  # plot reads a cp run as any


def test_loss_masked_data_with_cp_trains_like_one_process(data: Path, sft_one: tuple[dict, list, str]):
    (one, one_evals, _) = sft_one
    (cp, cp_evals, _) = train_run(data, "sft", "sftcp-cp2", ["--parallel.nproc", "2", "--parallel.cp", "2"])
    assert cp == pytest.approx(one, rel=1e-5)
    assert [e["val_loss"] for e in cp_evals] == pytest.approx([e["val_loss"] for e in one_evals], rel=1e-5)
    assert cp_evals[-1]["val_tokens"] == one_evals[-1]["val_tokens"]  # the same counted (response) tokens


# -- checkpoints across cp sizes

TINY = [*SMALL, "--model.n_layer", "2", "--optimizer.warmup_steps", "2", "--train.log_every", "1",
        "--train.steps", "6", "--train.ckpt_every", "3"]


@pytest.mark.parametrize("trained, resumed", [
    (["--parallel.cp", "2"], ["--parallel.cp", "1", "--parallel.nproc", "1"]),
], ids=["cp2-to-one"])  # (dp 2 ↔ cp 2 save the same dp×cp = 2 layout: nothing to reshard, so not a case here)
def test_resume_across_cp_sizes(tmp_path: Path, trained: list[str], resumed: list[str]):
    base = tmp_path / "base"
    base.mkdir()
    proc = cli(base, "train", *TINY, "--parallel.nproc", "2", *trained, "--train.name", "base")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    resume_in_layout(base / "runs" / "base", tmp_path, resumed)


# -- the planner may choose cp

def test_auto_with_a_cp_pin_trains(tmp_path: Path):
    proc = cli(tmp_path, "train", "--data.global_batch", "8", "--model.block_size", "32", "--model.n_layer", "2",
               "--optimizer.warmup_steps", "0",
               "--train.log_every", "1", "--train.steps", "2", "--train.ckpt_every", "0", "--parallel.nproc", "2",
               "--parallel.auto", "true", "--parallel.cp", "2", "--train.name", "auto")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    chosen = [line for line in proc.stdout.splitlines() if "parallel.auto chose" in line]
    assert len(chosen) == 1 and "cp=2" in chosen[0], proc.stdout
    assert "mesh dp=1 × cp=2 × tp=1" in proc.stdout
    run = tmp_path / "runs" / "auto"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "prediction" and rows[0]["plan"]["cp"] == 2
    assert json.loads((run / "config.json").read_text())["parallel"]["cp"] == 2
    assert sorted(losses(run)) == [1, 2]
