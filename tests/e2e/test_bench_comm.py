"""`shardwise bench comm` end to end: two torchrun ranks, table, JSON, calibration; bad flags fail early."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "comm", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_comm_two_ranks(tmp_path):
    out_json, cal = tmp_path / "rows.json", tmp_path / "cal.json"
    res = _cli("-n", "2", "--max", "64K", "--iters", "2", "--warmup", "1", "--plain",
               "--json", str(out_json), "--calibrate", str(cal))
    assert res.returncode == 0, res.stdout + res.stderr
    lines = [ln.split() for ln in res.stdout.splitlines() if ln and not ln.startswith("#")]
    # 3 ops x 4 algorithms x sizes 8..64K (all_gather/reduce_scatter: 8 B rounds up to 2 floats, kept once)
    assert len(lines) == 3 * 4 * 14
    for cells in lines:
        assert cells[2] == "float32" and cells[3] in ("native", "ring", "tree", "shm")
        assert cells[7] == "0"  # exact integer pattern: no error allowed
    data = json.loads(out_json.read_text())
    assert data["world_size"] == 2 and data["backend"] == "gloo" and len(data["results"]) == len(lines)
    for row in data["results"]:
        factor = 2 * (2 - 1) / 2 if row["op"] == "all_reduce" else (2 - 1) / 2
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * factor)
        assert row["algbw_GBps"] == pytest.approx(row["nbytes"] / row["time_us"] / 1e3)
        assert row["nbytes"] == row["count"] * 4 and row["max_error"] == 0
    calib = json.loads(cal.read_text())
    assert calib["world_size"] == 2 and calib["device"] == "cpu"
    assert set(calib["models"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    for algos in calib["models"].values():
        assert set(algos) == {"native", "ring", "tree", "shm"}
        for m in algos.values():
            assert m["alpha_us"] >= 0 and m["beta_us_per_byte"] >= 0 and m["points"] == 14


@pytest.mark.parametrize("args, message", [
    (["--min", "1M", "--max", "8"], "larger than --max"),
    (["--ops", "all_reduce,gossip"], "unknown collective"),
    (["--algorithms", "ring,star"], "unknown algorithm"),
    (["--min", "12X"], "not a byte count"),
    (["--iters", "0"], "must be >= 1"),
])
def test_bad_flags_exit_2_before_launch(args, message):
    res = _cli("-n", "2", *args, timeout=60)
    assert res.returncode == 2, res.stdout + res.stderr
    assert message in res.stderr
    assert "torch.distributed.run" not in res.stderr and res.stdout == ""
