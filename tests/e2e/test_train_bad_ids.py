"""A prepared shard holding a token id the model cannot embed, as a user meets it: ``shardwise prepare`` of one text
file into a folder that does not exist yet, then a damaged shard. The launch check refuses it in one line; and an
id that check did not read (the sampled scan of a large split, forced here by a ``sitecustomize`` that shrinks
the scan to a split's first and last token, in the launcher and the ranks alike) stops training with one line
naming the id, the vocabulary and the data — the rank prints no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tokenizers")

from shardwise.data.toy_tokenizer import train_bpe  # noqa: E402

SHRINK = ("import shardwise.data.prepared as p\n"
          "p.SCAN_ALL, p.SCAN_BLOCKS, p.SCAN_BLOCK = 0, 2, 1\n")


def _run(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bad-ids")
    lines = [f"line {i}: a sentence about item {i * 13 % 97} and the weather today." for i in range(1500)]
    (root / "big.txt").write_text("\n".join(lines) + "\n")
    (root / "tok").mkdir()
    train_bpe([root / "big.txt"], 300, root / "tok" / "tokenizer.json")
    proc = _run(root, "prepare", "big.txt", "--tokenizer", "tok", "--out", "data/web", "--val-fraction", "0.02",
                "--workers", "1")  # data/ does not exist; one text file gets a validation split
    assert proc.returncode == 0, proc.stderr
    shard = root / "data" / "web" / "train-00000.bin"
    ids = np.fromfile(shard, dtype="<u2")
    ids[len(ids) // 2] = 5000
    ids.tofile(shard)
    return root


def _train(cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    # 1 rank, no shuffling: every window is read in the first epoch, the damaged one at step 1 + its index // 8
    return _run(cwd, "train", "--data.path", "data/web", "--model.vocab_size", "512", "--model.block_size", "64",
                "--data.global_batch", "8", "--parallel.micro_batch", "8", "--parallel.nproc", "1",
                "--data.shuffle", "false", "--train.steps", "100", "--train.ckpt_every", "0", "--train.name", "b",
                env=env)


def test_the_launch_check_refuses_a_damaged_shard_in_one_line(damaged):
    proc = _train(damaged)
    err = proc.stderr.strip()
    assert proc.returncode == 2 and "\n" not in err and "Traceback" not in err, proc.stderr
    assert "holds token id 5000 (shard train-00000.bin)" in err and "512 ids" in err and "data/web" in err, err
    assert not (damaged / "runs" / "b" / "ranks").exists()  # no rank started


def test_an_id_the_check_missed_stops_training_in_one_line(damaged, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(SHRINK)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = _train(damaged, env)
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    failed = [ln for ln in proc.stderr.splitlines() if "failed at step" in ln]
    assert failed and "DataError: data.path = " in failed[0] and "holds token id 5000 (tokens " in failed[0], \
        proc.stderr
    assert "vocabulary has 512 ids" in failed[0] and "--model.vocab_size 5001" in failed[0]
