"""``shardwise bench planner --single-device`` end to end on the CPU with a tiny model: every chosen layout
trains through ``shardwise train --parallel.nproc 1``, is predicted with each ``--hardware``, and the plain
PyTorch loop is timed (the numbers are the CPU's; the command is meant for a GPU)."""

from __future__ import annotations

import json
import subprocess
import sys

TINY = ("--model.n_layer 1 --model.n_embd 64 --model.n_head 2 --model.block_size 32 --model.vocab_size 256 "
        "--data.global_batch 8")


def test_single_device_bench_trains_predicts_and_times_the_plain_loop(tmp_path):
    out = tmp_path / "single.json"
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise.cli", "bench", "planner", "--single-device", "--hardware",
         "h100-80g-sxm,h200-141g-sxm", "--steps", "4", "--only", "fp32 mb8 x2", "--model-flags", TINY,
         "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["layout"]: r for r in data["single_device"]}
    assert set(rows) == {"fp32 mb8 x2"} and data["failed"] == []
    for r in rows.values():
        assert r["device"] == "cpu" and r["measured_s"] > 0 and r["quick_probe_s"] > 0
        assert {"fwd", "bwd", "opt"} <= set(r["phases"]) and r["tokens"] == 8 * 32
        assert set(r["predicted"]) == {"h100-80g-sxm", "h200-141g-sxm"}
        # the H200 preset's faster memory never makes a step slower than the H100's
        assert r["predicted"]["h200-141g-sxm"]["step_s"] <= r["predicted"]["h100-80g-sxm"]["step_s"]
    plain = data["plain_loop"]
    assert plain["layout"] == "fp32 mb8 x2" and plain["step_s"] > 0 and plain["with_host_reads_s"] > 0
    assert "Plain PyTorch loop" in proc.stdout and "| fp32 mb8 x2 |" in proc.stdout
