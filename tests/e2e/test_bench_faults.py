"""The fault campaign (`python benchmarks/faults_campaign.py`) end to end: one corrupt-piece trial (a reference run, a flipped byte, export, resume);
the harness, not the rates. Kept to corrupt-piece only: a kill-rank trial adds two more launches (~40 s on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_faults_one_trial(tmp_path: Path) -> None:
    out, md = tmp_path / "faults.json", tmp_path / "faults.md"
    res = subprocess.run([sys.executable, str(REPO / "benchmarks" / "faults_campaign.py"), "--trials", "1", "--kinds",
                          "corrupt-piece", "--seed", "3", "--steps", "12", "--workdir", str(tmp_path / "runs"),
                          "--out", str(out), "--markdown", str(md)],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {"platform", "cpu_count", "torch"} <= set(data["machine"]) and data["command"].startswith("python benchmarks/faults_campaign.py")
    assert [row["kind"] for row in data["summary"]] == ["corrupt-piece"]
    for row in data["summary"]:
        assert row["trials"] == 1
        for col in ("max_exit_s", "named_pct", "loadable_pct", "resumed_identical_pct", "detected_pct"):
            assert row[col] is None or isinstance(row[col], (int, float)), (col, row)
    (corrupt,) = data["trials"]
    assert corrupt["kind"] == "corrupt-piece" and "harness error" not in corrupt["note"]
    assert corrupt["victim"].startswith("rank") and ".safetensors:" in corrupt["victim"]
    for col in ("loadable", "resumed_identical", "detected"):
        assert isinstance(corrupt[col], bool), (col, corrupt)
    assert corrupt["named"] is None and "| corrupt-piece |" in md.read_text()
