"""``shardwise verify`` end to end: a correct layout passes, an injected bug is caught.

SGD with a large learning rate makes gradient-scale bugs visible (Adam would normalise a constant factor away).
"""

from __future__ import annotations

import subprocess
import sys

FLAGS = ["--optimizer.name", "sgd", "--optimizer.lr", "0.3", "--optimizer.warmup_steps", "0", "--steps", "3",
         "--data.global_batch", "8", "--parallel.micro_batch", "2"]


def verify(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "verify", *FLAGS, *args], capture_output=True,
                          text=True, timeout=150, cwd=tmp_path)


def test_verify_passes_for_tensor_parallel_1x2(tmp_path):
    proc = verify(tmp_path, "--parallel.tp", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 process vs dp=1 × tp=2" in proc.stdout and "OK: 3 steps agree" in proc.stdout
    assert "DIFFERS" not in proc.stdout


def test_verify_catches_gradients_summed_instead_of_averaged(tmp_path):
    proc = verify(tmp_path, "--debug.bug", "sum_grads")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIFFERS" in proc.stdout and "FAILED: losses differ" in proc.stderr
