"""``shardwise bench tp`` end to end on a tiny stack: every variant in the table and the JSON (with the
shared-memory variants, which compute the same function as the native ones, and with ``--async-tp`` the
overlapped twin of each sw variant, paired with it)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_two_ranks_json_with_shared_memory_variants(tmp_path):
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "tp", "-n", "2", "--layers", "1",
                           "--embd", "32", "--heads", "2", "--batch", "2", "--seq", "8", "--steps", "1",
                           "--warmup", "1", "--repeats", "2", "--iters", "2", "--async-tp", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = {r["variant"]: r for r in data["steps"]}
    sync = {"sw", "sw-sp", "sw-shm", "sw-sp-shm"}
    assert set(rows) == sync | {"torch", "torch-sp"} | {f"{v}-async" for v in sync}
    assert all(r["step_ms"] > 0 for r in rows.values())
    assert all(rows[f"{v}-async"]["vs_sync"] > 0 and len(rows[f"{v}-async"]["vs_sync_range"]) == 2 for v in sync)
    assert all(0 < rows[v]["comm_share"] < 1 for v in sync)
    assert rows["torch"]["vs_torch"] == 1.0 and rows["sw-sp-shm"]["vs_torch"] > 0
    assert data["loss_check"] == 0.0  # ours and torch's first loss agree exactly
    assert data["args"]["layers"] == 1 and "_bench_parser" not in data["args"]
