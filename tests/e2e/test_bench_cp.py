"""`shardwise bench cp` end to end: two torchrun ranks at a tiny size (cp 1 and 2), the table and the JSON rows,
activation memory per rank falling with cp, the ring sending K/V blocks of the kv heads; bad flags fail early."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "cp", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_cp_two_ranks(tmp_path):
    out = tmp_path / "cp.json"
    seq, embd, heads, kv_heads = 256, 128, 4, 2
    res = _cli("-n", "2", "--cp", "1,2", "--seq", str(seq), "--embd", str(embd), "--heads", str(heads),
               "--kv-heads", str(kv_heads), "--repeats", "1", "--hardware",
               str(REPO / "benchmarks" / "hardware_cpu_2ranks.json"), "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "shardwise bench cp: 2 ranks" in res.stdout and "saved MiB" in res.stdout
    table = [ln.split() for ln in res.stdout.splitlines() if ln.split() and ln.split()[0] in ("1", "2")]
    assert [cells[0] for cells in table] == ["1", "2"]
    data = json.loads(out.read_text())
    assert data["seq"] == seq and data["ranks"] == 2
    one, two = data["rows"]
    assert (one["cp"], two["cp"]) == (1, 2)
    for row in (one, two):
        assert row["saved_bytes"] > 0 and len(row["saved_per_layer_bytes"]) == 2
        assert all(b > 0 for b in row["saved_per_layer_bytes"])
        assert row["step_s"] > 0 and row["predicted_activation_bytes"] > 0
    # activations are per token: two ranks each keep about half of what one rank keeps (margin for the few
    # per-sequence tensors)
    assert two["saved_bytes"] < 0.6 * one["saved_bytes"]
    assert all(b2 < 0.6 * b1 for b1, b2 in zip(one["saved_per_layer_bytes"], two["saved_per_layer_bytes"]))
    # measured within 25 % of the planner's activations
    for row in (one, two):
        assert row["saved_bytes"] == pytest.approx(row["predicted_activation_bytes"], rel=0.25)
    # the ring: K and V of the rank's seq/2 tokens with the kv heads only (grouped-query attention), fp32
    assert two["kv_bytes_per_hop"] == 2 * (seq // 2) * kv_heads * (embd // heads) * 4
    assert two["ring_s"] > 0 and two["exposed_s"] >= 0 and two["alone_s"] > 0
    assert 0.0 <= two["hidden"] <= 1.0 and two["predicted_cp_comm_s"] > 0
    assert one["speedup"] == pytest.approx(1.0) and two["speedup"] > 0
    assert two["hop_s"] > 0 and 0 <= two["hop_under_compute_s"] <= 10 * two["hop_s"] + 0.05
    assert "one bare K/V hop" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--cp", "1,3"], "divide -n"),
    (["--seq", "250"], "divisible by 2·cp"),
    (["--heads", "3"], "must divide --embd"),
    (["--cp", "x"], "comma list of ints"),
])
def test_bad_flags_exit_2_before_launch(args, message):
    res = _cli("-n", "2", "--cp", "1,2", *args, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr
    assert "torch.distributed.run" not in res.stderr and res.stdout == ""
