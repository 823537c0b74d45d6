"""``shardwise run`` end to end: torchrun underneath, environment read by sw.init(), exit codes."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent("""
    import sys, torch, shardwise as sw
    world = sw.init()
    mesh = sw.Mesh(dp=-1)
    x = torch.full((5,), float(world.rank + 1))
    sw.comm.all_reduce(x, mesh, "dp", algorithm="ring")
    if world.rank == int(sys.argv[1]):
        raise SystemExit(3)
    print(f"rank {world.rank}/{world.world_size} sum={x[0].item():g} arg={sys.argv[2]}", flush=True)
    sw.shutdown()
""")


def _run(tmp_path: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, "-m", "shardwise.cli", "run", *args[:-2], str(script), *args[-2:]],
                          capture_output=True, text=True, timeout=timeout, cwd=tmp_path)


def test_run_two_ranks(tmp_path):
    proc = _run(tmp_path, "-n", "2", "-1", "hello")
    assert proc.returncode == 0, proc.stderr
    assert "rank 0/2 sum=3 arg=hello" in proc.stdout and "rank 1/2 sum=3 arg=hello" in proc.stdout


def test_a_failing_rank_fails_the_job(tmp_path):
    proc = _run(tmp_path, "-n", "2", "1", "x")
    assert proc.returncode != 0


def test_without_a_launcher_init_makes_a_world_of_one(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), "-1", "solo"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "rank 0/1 sum=1 arg=solo" in proc.stdout
