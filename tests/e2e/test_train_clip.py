"""``shardwise train --optimizer.clip_grad_norm`` end to end through the CLI: every step's record in ``metrics.jsonl``
carries the global gradient norm before clipping (``grad_norm``), and two layouts — dp 2 and a 2-stage pipeline
(the tied embedding and head on different ranks) — log the same norms and losses (another layout sums in another
order: equal up to float noise, rel 1e-4). SGD, so the clipped gradient's size shows in the later losses; the
norm-per-layout parity with one device is tests/dist/test_clip_grad_norm.py's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.e2e.runs import cli, losses

MAX_NORM = 0.5
FLAGS = ["--data.global_batch", "8", "--parallel.micro_batch", "2", "--optimizer.warmup_steps", "0",
         "--optimizer.name", "sgd", "--optimizer.lr", "0.3", "--train.log_every", "1", "--train.steps", "3",
         "--train.ckpt_every", "0", "--optimizer.clip_grad_norm", str(MAX_NORM)]


def _norms(run: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["grad_norm"] for r in rows if "kind" not in r}


def test_clipped_runs_log_the_norm_and_agree_across_layouts(tmp_path):
    runs = {}
    for name, layout in (("dp2", []), ("pp2", ["--parallel.pp", "2"])):
        proc = cli(tmp_path, "train", *FLAGS, "--train.name", name, *layout, timeout=150)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[name] = tmp_path / "runs" / name
    dp, pp = _norms(runs["dp2"]), _norms(runs["pp2"])
    assert sorted(dp) == sorted(pp) == [1, 2, 3]
    for step in dp:
        assert math.isfinite(dp[step]) and dp[step] > MAX_NORM, (step, dp[step])  # clipping bit at every step
        assert pp[step] == pytest.approx(dp[step], rel=1e-4), (step, pp[step], dp[step])
    want, got = losses(runs["dp2"]), losses(runs["pp2"])
    for step in (1, 2, 3):
        assert got[step] == pytest.approx(want[step], rel=1e-4), (step, got[step], want[step])
    pytest.importorskip("matplotlib")
    from shardwise.cli.plot import plot_run

    paths = plot_run(runs["pp2"], tmp_path / "plots")
    assert [p.name for p in paths] == ["loss.png", "throughput.png", "grad_norm.png"]
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
