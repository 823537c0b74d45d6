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
    # with sequence parallelism and async tensor parallelism: the overlapped rings (parallel/tensor/overlap.py)
    # equal one process too; the plain tp layouts are verified by the dist and train tests
    proc = verify(tmp_path, "--parallel.tp", "2", "--parallel.sequence_parallel", "true", "--parallel.async_tp", "true")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 process vs dp=1 × tp=2" in proc.stdout and "OK: 3 steps agree" in proc.stdout
    assert "async tp" in proc.stdout
    assert "DIFFERS" not in proc.stdout


def test_verify_catches_gradients_summed_instead_of_averaged(tmp_path):
    proc = verify(tmp_path, "--debug.bug", "sum_grads")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "DIFFERS" in proc.stdout and "FAILED: losses differ" in proc.stderr


def test_verify_runs_both_sides_in_the_requested_precision(tmp_path, monkeypatch):
    """In-process (no ranks start): ``--train.precision bf16`` reaches the reference and the layout alike, and the
    default tolerance becomes bf16's (rtol 4e-3 ≈ 2^-8; an explicit --rtol wins). Measured with FLAGS + bf16:
    tp 2, ZeRO-3 and pp 2 zb-h1 within 1.9e-4 of one process, ``--debug.bug sum_grads`` 0.32 off at step 2."""
    import argparse

    from shardwise.cli import verify as verify_cmd

    monkeypatch.chdir(tmp_path)

    def configs(*argv: str):
        parser = argparse.ArgumentParser()
        verify_cmd.add_arguments(parser)
        args = parser.parse_args([*FLAGS, "--parallel.nproc", "2", *argv])
        reference, layout, _ = verify_cmd._configs(args)
        return reference, layout, args

    reference, layout, args = configs("--train.precision", "bf16")
    assert reference.train.precision == layout.train.precision == "bf16"
    assert (args.rtol, args.atol) == verify_cmd.TOLERANCES["bf16"] == (4e-3, 1e-5)
    assert "bf16 autocast" in verify_cmd._describe(layout)
    _, layout, args = configs("--rtol", "1e-3")
    assert layout.train.precision == "fp32" and (args.rtol, args.atol) == (1e-3, 1e-5)
