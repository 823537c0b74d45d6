"""`shardwise calibrate --quick` end to end on two torchrun ranks: the hardware file's schema, and that the planner
and the trainer's "auto" read it back (bad flags: tests/e2e/test_bad_inputs.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from shardwise.comm.hardware import HARDWARE_FORMAT, hardware_collectives, load_hardware_calibration

REPO = Path(__file__).resolve().parents[2]


def test_calibrate_quick_two_ranks(tmp_path):
    out = tmp_path / "hw.json"
    res = subprocess.run([sys.executable, "-m", "shardwise.cli", "calibrate", "--nproc", "2", "--quick", "--out",
                          str(out)], cwd=REPO, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"# wrote {out}" in res.stdout and "auto all_reduce on 2 ranks: 1K " in res.stdout
    raw = json.loads(out.read_text())
    assert list(raw) == ["format", "name", "device", "backend", "devices_per_node", "memory_bytes", "probe",
                         "collectives", "machine"]
    doc = load_hardware_calibration(out)
    assert doc["format"] == HARDWARE_FORMAT and doc["name"] == "local-cpu-2" and doc["devices_per_node"] == 2
    assert doc["device"] == "cpu" and doc["backend"] == "gloo" and doc["memory_bytes"] > 0
    probe = doc["probe"]
    assert set(probe["gemm"]) == {"float32", "bfloat16"} and len(probe["gemm"]["float32"]) >= 4
    assert 1e6 < probe["memory_bandwidth_Bps"] < 1e13 and 1e-8 < probe["op_overhead_s"] < 1e-2
    # the block probe: a stack of blocks, per-block times, plain and under activation checkpointing
    block = probe["block"]
    assert block["depth"] == 4 and 0 < block["fwd_s"] < block["ckpt_s"] and block["bwd_s"] > 0
    # ... and the tiny block whose time is launch overhead (far cheaper than a probe block)
    assert 0 < block["tiny_s"] < block["fwd_s"] + block["bwd_s"]
    assert probe["sync_skew_s"] >= 0
    assert set(doc["machine"]) == {"host", "cpus", "torch", "gpu"} and doc["machine"]["gpu"] is None
    (cal,) = hardware_collectives(doc)  # two ranks: one group size
    assert cal.world_size == 2 and set(cal.models) == {"all_reduce", "all_gather", "reduce_scatter", "broadcast"}
    assert all(set(algos) == {"native", "ring", "tree", "shm"} for algos in cal.models.values())
    from shardwise.planner.hardware import Hardware

    hw = Hardware.load(out)
    assert hw.devices_per_node == 2 and set(hw.collectives) == {2}
