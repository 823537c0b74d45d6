"""The ``corrupt-piece`` trial of the fault campaign (``benchmarks/faults_campaign.py``): flip one byte inside a tensor's data in the newest
checkpoint of a finished run; ``verify_checkpoint``, ``shardwise export`` and ``shardwise train --resume`` must
each notice, and the resume must fall back to the previous checkpoint and reproduce the reference losses."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from shardwise.checkpoint.sharded import CheckpointError, latest_checkpoint, latest_intact_checkpoint, verify_checkpoint
from .trials import _JOB_TIMEOUT_S, Reference, Setup, resume

__all__ = ["flip_byte", "trial_corrupt_piece"]


def _tensors(path: Path) -> tuple[int, dict[str, tuple[int, int]]]:
    """(header length N, tensor → (start, end) data offsets relative to byte 8 + N) of a safetensors file,
    tensors with at least one byte only."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    return n, {k: tuple(v["data_offsets"]) for k, v in header.items()
               if k != "__metadata__" and v["data_offsets"][1] > v["data_offsets"][0]}


def flip_byte(ckpt: Path, rng: random.Random) -> str:
    """Flip (xor 0xFF) one random byte inside the data of a random tensor of a random piece file of ``ckpt``
    (among the files holding data: with dp only, rank 0 owns every replicated tensor); returns what was hit."""
    files = [p for p in sorted(ckpt.glob("rank*.safetensors")) if _tensors(p)[1]]
    path = files[rng.randrange(len(files))]
    n, tensors = _tensors(path)
    name = sorted(tensors)[rng.randrange(len(tensors))]
    lo, hi = tensors[name]
    at = 8 + n + rng.randrange(lo, hi)
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))
    return f"{path.name}:{name}@{at}"


def _export_one_line(launch_dir: Path, ckpt_run: Path) -> tuple[int, str]:
    argv = [sys.executable, "-m", "shardwise.cli", "export", str(ckpt_run), "--out", str(launch_dir / "x.safetensors")]
    res = subprocess.run(argv, capture_output=True, text=True, timeout=_JOB_TIMEOUT_S)
    return res.returncode, res.stderr


def trial_corrupt_piece(setup: Setup, ref: Reference, rng: random.Random, rec: dict[str, Any]) -> None:
    """Flip a byte in the newest checkpoint of a finished run (a copy of the reference run): verify, export and
    ``--resume`` must all notice; the resume must fall back to the previous checkpoint and match the reference."""
    run_dir = setup.workdir / f"{rec['kind']}-{rec['trial']:03d}"
    shutil.copytree(ref.run_dir, run_dir, ignore=shutil.ignore_patterns("tensorboard"))
    damaged = latest_checkpoint(run_dir)
    assert damaged is not None
    rec["victim"] = flip_byte(damaged, rng)
    try:
        verify_checkpoint(damaged)
        raised = False
    except CheckpointError:
        raised = True
    rc, err = _export_one_line(setup.workdir, run_dir)
    exported = rc == 2 and len(err.strip().splitlines()) == 1
    fallback, _ = latest_intact_checkpoint(run_dir)
    rec["loadable"] = fallback is not None and fallback != damaged
    launch = resume(setup, run_dir, rec, ref)
    text = launch.stderr.read_text(errors="replace") if launch else ""
    warned = f"skipping damaged checkpoint {damaged}" in text
    fell_back = fallback is not None and f"resuming {fallback}" in launch.stdout.read_text() if launch else False
    rec["detected"] = raised and exported and warned and fell_back
    rec["exit_code"] = rec["resume_rc"]
    rec["note"] += f"verify raised={raised} export rc={rc} lines={len(err.strip().splitlines())} " \
                   f"warned={warned} fell_back={fell_back}. "
