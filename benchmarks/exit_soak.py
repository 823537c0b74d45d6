"""Clean exits of user scripts under ``shardwise run`` (benchmarks/RESULTS.md, "Exits of user scripts").

    python benchmarks/exit_soak.py --runs 20 --load [--only readme,sbp3,pipeline2] [--json out.json]

Each script calls ``sw.init()``, does its work and ends without ``sw.shutdown()``, as users' scripts do:

- ``readme``: the README's "In code" example (read from README.md, 2 ranks: tensor parallelism over tp);
- ``sbp3``: 3 ranks box a global tensor ``S(0)`` -> ``B`` -> ``S(1)`` -> ``P`` -> ``B`` (``to_sbp``);
- ``pipeline2``: the 2-stage pipeline of docs/pipelines.md (1F1B, 4 micro-batches, one optimizer step).

Every script prints a last line (``done RANK``) after its work; a run counts as *clean* when it exits 0 and
every rank printed that line. An *abort* is a run whose output names SIGABRT or "terminate called" (gloo's
threads torn down during interpreter finalisation). ``--load`` runs a busy loop (one Python process spinning)
beside the runs for the whole campaign, as the measurements that found the aborts did. The scripts are written
to a temporary directory; the table lists runs, clean runs, aborts and the exit codes seen.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SBP3 = textwrap.dedent("""
    import torch, shardwise as sw

    world = sw.init()
    mesh = sw.Mesh(dp=-1)
    full = torch.arange(36.0).reshape(6, 6)
    x = sw.distribute(full, mesh, "S(0)")
    for sbp in ("B", "S(1)", "P", "B", "S(0)"):
        x = x.to_sbp(sbp)
    assert torch.equal(x.full(), full)
    print(f"done {world.rank}", flush=True)
""")

PIPELINE2 = textwrap.dedent("""
    import torch, shardwise as sw
    from shardwise.models import GPT, GPTConfig, lm_loss, synthetic_batch

    world = sw.init()
    mesh = sw.Mesh(pp=-1)
    cfg = GPTConfig.preset("gpt-tiny")
    torch.manual_seed(0)
    pipe = sw.pipeline(GPT(cfg), mesh, "pp", microbatches=4, schedule="1f1b", loss_fn=lm_loss)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    idx, targets = synthetic_batch(8, cfg.block_size, cfg.vocab_size, torch.Generator().manual_seed(0))
    loss = pipe.step(idx, targets)
    opt.step(); opt.zero_grad()
    print(f"done {world.rank}", flush=True)
""")


def readme_example() -> str:
    """The python block under "## In code" in README.md, with the ``done RANK`` line appended."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## In code"):]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    if code is None:
        raise SystemExit("README.md: no python block under '## In code'")
    return code.group(1) + "print(f'done {torch.distributed.get_rank()}', flush=True)\n"


SCRIPTS = {"readme": (readme_example, 2), "sbp3": (lambda: SBP3, 3), "pipeline2": (lambda: PIPELINE2, 2)}


def run_once(script: Path, ranks: int, timeout_s: float) -> tuple[int, bool, bool]:
    """(exit code, clean, aborted) of one ``shardwise run -n RANKS script``."""
    try:
        proc = subprocess.run([sys.executable, "-m", "shardwise.cli", "run", "-n", str(ranks), str(script)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=script.parent)
    except subprocess.TimeoutExpired:
        return -999, False, False
    out = proc.stdout + proc.stderr
    done = all(f"done {r}" in proc.stdout for r in range(ranks))
    aborted = "terminate called" in out or "SIGABRT" in out or "Signals.SIGABRT" in out
    return proc.returncode, proc.returncode == 0 and done, aborted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each script (default 20)")
    parser.add_argument("--load", action="store_true", help="spin a busy loop beside the runs")
    parser.add_argument("--only", default=",".join(SCRIPTS), help=f"comma-separated subset of {list(SCRIPTS)}")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="per run (default 300)")
    parser.add_argument("--json", type=Path, default=None, help="also write the table as JSON here")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SCRIPTS]
    if unknown:
        raise SystemExit(f"--only: unknown script(s) {unknown}; choose from {list(SCRIPTS)}")
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.load else None
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="exit_soak_") as tmp:
            for name in names:
                make, ranks = SCRIPTS[name]
                script = Path(tmp) / f"{name}.py"
                script.write_text(make())
                codes: collections.Counter[int] = collections.Counter()
                clean = aborts = 0
                start = time.perf_counter()
                for _ in range(args.runs):
                    code, ok, aborted = run_once(script, ranks, args.timeout_s)
                    codes[code] += 1
                    clean += ok
                    aborts += aborted
                rows.append({"script": name, "ranks": ranks, "runs": args.runs, "clean": clean, "aborts": aborts,
                             "exit_codes": dict(sorted(codes.items())),
                             "s_per_run": round((time.perf_counter() - start) / args.runs, 2)})
                print(_row(rows[-1]), flush=True)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    print(f"\nload: {'one busy loop' if args.load else 'none'}")
    print(f"{'script':<10} {'ranks':>5} {'runs':>5} {'clean':>6} {'aborts':>7}  exit codes")
    for row in rows:
        print(_row(row))
    if args.json is not None:
        args.json.write_text(json.dumps({"load": args.load, "rows": rows}, indent=1) + "\n")


def _row(row: dict) -> str:
    codes = ", ".join(f"{c}×{n}" for c, n in row["exit_codes"].items())
    return f"{row['script']:<10} {row['ranks']:>5} {row['runs']:>5} {row['clean']:>6} {row['aborts']:>7}  {codes}"


if __name__ == "__main__":
    main()
