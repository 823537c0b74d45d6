"""``shardwise bench sbp`` end to end: overhead rows against DTensor and the boxing bytes table."""

from __future__ import annotations

import subprocess
import sys


def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "sbp", *args], capture_output=True,
                          text=True, timeout=240)


def test_two_ranks_prints_overheads_and_planned_bytes():
    proc = _bench("-n", "2", "--iters", "40")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    for op in ("add 64x64", "linear 64x64", "gelu 64x64", "S(0) -> B all-gather"):
        assert op in out
    rows = {tuple(ln.split()[:2]): ln.split() for ln in out.splitlines() if ln[:1] in "SBP" and len(ln.split()) >= 3}
    # 1024x1024 float32 = 4 MiB on 2 ranks: S->B gathers the other 2 MiB half; P->B ring all-reduce sends 4 MiB.
    assert rows[("S(0)", "B")][2] == str(2 << 20) and rows[("P", "B")][2] == str(4 << 20)
    assert rows[("B", "S(1)")][2] == "0" and rows[("S(0)", "S(1)")][3] == "all_to_all"


def test_bad_iters_fails_before_launch():
    proc = _bench("--iters", "0")
    assert proc.returncode == 2 and "--iters" in proc.stderr
