"""``shardwise bench moe`` end to end on tiny sizes: part (a) in the launching process, part (b) on 2 local ranks
through the launcher (the workers get the flags back, rank 0's table comes back to the launcher's JSON)."""

from __future__ import annotations

import json
import subprocess
import sys

from shardwise.bench.moe_peer import peer_available


def test_both_parts_into_one_json(tmp_path):
    out = tmp_path / "moe.json"
    proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "moe", "-n", "2", "--experts", "4,8",
                           "--tokens", "64", "--hidden", "32", "--ffn", "16", "--n-experts", "4", "--layers", "1",
                           "--embd", "32", "--moe-ffn", "16", "--batch", "2", "--seq", "8", "--steps", "1",
                           "--warmup", "0", "--repeats", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["experts"] for r in data["grouped"]] == [4, 8]
    assert all(r["max_rel_diff"] < 1e-5 for r in data["grouped"])
    ep = data["ep"]
    assert ep["ranks"] == 2 and ep["ep"] == 2
    rows = {r["variant"]: r for r in ep["rows"]}
    assert all(r["step_ms"] > 0 for r in rows.values())
    if peer_available() is None:
        assert set(rows) == {"sw", "sw-pairwise", "hf"}
        assert rows["hf"]["vs_hf"] == 1.0 and rows["sw"]["vs_hf"] > 0
    else:  # an older transformers: the peer is left out with a line, ours still run
        assert set(rows) == {"sw", "sw-pairwise"} and "hf left out" in proc.stdout
    assert ep["loss_spread"] < 1e-5 and set(ep["first_losses"]) == set(rows)
    assert "(b) expert parallelism" in proc.stdout and "(a) one MoE block" in proc.stdout
