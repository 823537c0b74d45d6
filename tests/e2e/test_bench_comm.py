"""``shardwise bench comm`` end to end: table, JSON, calibration file, and errors before any rank starts."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from shardwise.comm.calibration import load_calibration


def _bench(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "comm", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_two_ranks_table_json_and_calibration(tmp_path):
    out, cal = tmp_path / "comm.json", tmp_path / "cal.json"
    proc = _bench("-n", "2", "--min", "8", "--max", "64K", "--iters", "2", "--warmup", "1", "--plain",
                  "--json", str(out), "--calibrate", str(cal))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    # 3 ops x 3 algorithms x 14 sizes (8 B .. 64 KiB), each checked against the exact result.
    assert len(lines) == 3 * 3 * 14, proc.stdout
    assert all(ln.split()[-1] == "0" for ln in lines), "max error column must be exactly 0 on integer data"
    rows = json.loads(out.read_text())["results"]
    assert {(r["op"], r["algorithm"]) for r in rows} == {(o, a) for o in ("all_reduce", "all_gather", "reduce_scatter")
                                                        for a in ("native", "ring", "tree")}
    for r in rows:  # busbw = algbw x the nccl-tests factor
        factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}[r["op"]]
        assert abs(r["busbw_GBps"] - r["algbw_GBps"] * factor) <= 1e-9 + 1e-6 * r["algbw_GBps"]
    model = load_calibration(cal)
    assert model.world_size == 2 and model.predict_us("all_reduce", "ring", 1 << 20) > 0


def test_bad_flags_fail_before_any_rank_starts():
    for args, word in ((["--min", "1M", "--max", "8"], "larger than"), (["--ops", "all_to_all"], "unknown"),
                       (["--algorithms", "butterfly"], "unknown")):
        start = time.monotonic()
        proc = _bench(*args, timeout=60)
        assert proc.returncode == 2, (args, proc.stderr)
        assert word in proc.stderr, (args, proc.stderr)
        assert "torch.distributed.run" not in proc.stderr and time.monotonic() - start < 30
