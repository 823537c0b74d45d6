"""``shardwise train`` with a mixture of experts in a pipeline (``--parallel.pp 2 --parallel.ep 2`` on 4 processes,
zero-bubble schedule) end to end through the CLI, against the single-process run of the same config: the logged
losses, the routing statistics in the metrics, and the exported weights (the experts gathered from the pieces
the pipeline checkpoint holds). The layouts themselves are checked value by value in
tests/dist/test_moe_pipeline.py; this is the launch, the metrics and the checkpoint on the way out.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_train_pp import cli

FLAGS = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.lr", "0.01", "--optimizer.eps", "1e-4",
         "--optimizer.warmup_steps", "0", "--optimizer.schedule", "constant", "--train.log_every", "1",
         "--train.steps", "2", "--train.ckpt_every", "2", "--model.n_layer", "2", "--model.n_experts", "4",
         "--model.top_k", "2", "--model.moe_ffn", "32", "--model.n_shared_experts", "1",
         "--model.moe_aux_loss_coef", "0.05", "--model.capacity_factor", "1.0"]


def _train(cwd: Path, name: str, *flags: str) -> Path:
    val = cwd / "val.txt"  # a validation pass at the last step: forward only, the experts' all-to-alls included
    val.write_text("the validation text of a mixture of experts, forward only. " * 40)
    proc = cli(cwd, "train", *FLAGS, "--train.name", name, "--train.eval_every", "2", "--data.val_path", str(val),
               *flags, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd / "runs" / name


def _records(run: Path, kind: str | None = None) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r.get("kind") == kind}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    cwd = tmp_path_factory.mktemp("moe_pp")
    return (_train(cwd, "one", "--parallel.nproc", "1"),
            _train(cwd, "pp2ep2", "--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.ep", "2",
                   "--parallel.pp_schedule", "zb-h1"))


def test_pp2_ep2_trains_like_one_process(runs):
    one, pp = runs
    want, got = _records(one), _records(pp)
    assert sorted(got) == [1, 2]
    for step in (1, 2):
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=1e-5), step
        # rank 0 logs every stage's blocks (gathered over pp), loads summed over each stage's dp ranks
        stats = got[step]["moe"]
        assert list(stats) == ["blocks.0.mlp", "blocks.1.mlp"], stats
        for block in stats:
            for key in ("min", "max", "dropped", "starved"):
                assert stats[block][key] == want[step]["moe"][block][key], (step, block, key)
    evals = _records(pp, "eval")
    assert list(evals) == [2] and evals[2]["val_loss"] == pytest.approx(_records(one, "eval")[2]["val_loss"], rel=1e-5)


def test_pp2_ep2_export_equals_one_process(runs, tmp_path):
    import torch
    from safetensors.torch import load_file

    for run in runs:
        proc = cli(tmp_path, "export", str(run), "--out", str(tmp_path / f"{run.name}.safetensors"))
        assert proc.returncode == 0, proc.stdout + proc.stderr
    got, want = (load_file(str(tmp_path / f"{r.name}.safetensors")) for r in reversed(runs))
    assert sorted(got) == sorted(want)
    assert got["blocks.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # whole experts, from the two ep pieces
    init = 0.01 * 2  # AdamW at lr 0.01 for 2 steps moves each weight by up to ~0.02
    for key in want:
        assert torch.allclose(got[key], want[key], rtol=0, atol=1e-5 * init), key
