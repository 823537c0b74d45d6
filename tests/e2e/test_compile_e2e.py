"""``--train.compile true`` end to end: ``shardwise verify`` of a compiled zero-bubble pipeline (ZB-H1: W
differentiates each stage again, no weight capture inside a compiled block: its compiled backward runs twice,
which AOTAutograd's donated buffers would forbid), against one eager process; and ``shardwise bench compile`` on
a tiny model, whose compiled and eager runs of the trainer's own layouts (ZeRO-3 over dp=2, a 1F1B
pipeline) must see the same losses.

The verify run compiles with inductor (C++ kernels on the CPU ranks); the bench smoke with ``aot_eager`` (dynamo
and AOTAutograd, no code generation) to keep it cheap: it checks the command and that the compiled layouts
compose (same losses), inductor's numerics are checked by the verify run and tests/dist/test_compile.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

FLAGS = ["--optimizer.name", "sgd", "--optimizer.lr", "0.3", "--optimizer.warmup_steps", "0", "--steps", "3",
         "--data.global_batch", "8", "--parallel.micro_batch", "2"]


def test_verify_compiled_zero_bubble_pipeline(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "verify", *FLAGS, "--parallel.pp", "2",
                           "--parallel.pp_schedule", "zb-h1", "--train.compile", "true"], capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "compiled (inductor), zb-h1" in proc.stdout and "OK: 3 steps agree" in proc.stdout, proc.stdout
    assert "DIFFERS" not in proc.stdout and "recompile at step" not in proc.stdout
    runs = tmp_path / "runs" / "verify-gpt-tiny"
    steps = [json.loads(line) for line in (runs / "layout" / "metrics.jsonl").read_text().splitlines()]
    assert [r["recompiles"] for r in steps if "kind" not in r] == [0, 0, 0]  # each step record says so
    assert "recompiles" not in (runs / "reference" / "metrics.jsonl").read_text()  # the reference ran eagerly
    for rank in (0, 1):  # the summary's entries: compile time on each rank, no recompile
        summary = json.loads((runs / "layout" / "ranks" / f"rank0000{rank}.json").read_text())
        assert summary["compile_s"] > 0 and summary["compile_graphs"] >= 1 and summary["recompiles"] == 0, summary


def test_bench_compile_layouts_agree_with_eager(tmp_path):
    out = tmp_path / "compile.json"
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "compile", "-n", "2", "--preset",
                           "gpt-tiny", "--layouts", "zero3,pp2", "--micro-batch", "2", "--steps", "1",
                           "--repeats", "2", "--warmup", "1", "--backend", "aot_eager", "--json", str(out)],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["layout"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"zero3", "pp2"}
    for name, r in rows.items():
        assert r["max_rel_dloss"] <= 1e-5 and r["recompiles"] == 0, (name, r)
        assert r["ratio"] > 0 and len(r["rounds_compiled"]) == 2, (name, r)
    assert rows["zero3"]["graphs"] >= 1 and rows["zero3"]["compile_s"] > 0  # the first layout compiled the block
    assert "max rel dloss" in proc.stdout
