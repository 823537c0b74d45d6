"""A seeded fault campaign against real ``shardwise train`` jobs (run from a checkout; not installed).

    python benchmarks/faults_campaign.py --trials 20 --seed 0 --out benchmarks/faults.json \
        --markdown benchmarks/faults.md

Kinds (``--trials`` each, ``--kinds`` for a subset): ``kill-rank`` (SIGKILL a random rank at a random time),
``kill-in-save`` (SIGKILL a rank while a checkpoint is being written), ``kill-launcher`` (SIGKILL the launcher:
its ranks must go and nothing be written after), ``sigstop-rank`` (SIGSTOP a rank: the job must end within
``train.timeout_s`` + 10 s), ``corrupt-piece`` (flip a byte in a finished checkpoint: verify, export and resume
must notice). One uninterrupted reference run comes first; every resumed trial must reproduce its losses
exactly. One ``random.Random(seed)`` draws the whole schedule (victims, kill times: a step after the first
checkpoint plus a fraction of a step, bytes to flip). Trials in ``faults/trials.py`` and
``faults/corrupt.py``, tables in ``faults/report.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a script: the repository root makes ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.faults.corrupt import trial_corrupt_piece
from benchmarks.faults.report import markdown, print_table, summarize
from benchmarks.faults.trials import (KINDS, Reference, Setup, empty_record, run_reference, trial_kill_in_save,  # noqa: E402
                                      trial_kill_launcher, trial_kill_rank, trial_sigstop_rank)

TRIALS: dict[str, Callable[[Setup, Reference, random.Random, dict[str, Any]], None]] = {
    "kill-rank": trial_kill_rank, "kill-in-save": trial_kill_in_save, "kill-launcher": trial_kill_launcher,
    "sigstop-rank": trial_sigstop_rank, "corrupt-piece": trial_corrupt_piece,
}

__all__ = ["add_arguments", "main"]

_PROG = "benchmarks/faults_campaign.py"


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise argparse.ArgumentTypeError(f"unknown kind {bad[0] if bad else text!r}; choose from {', '.join(KINDS)}")
    return kinds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trials", type=int, default=20, help="trials per kind (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the whole schedule (default 0)")
    parser.add_argument("--kinds", type=_kinds, default=list(KINDS), metavar="K1,K2",
                        help=f"comma-separated subset of {', '.join(KINDS)} (default all)")
    parser.add_argument("--out", default=None, metavar="JSON", help="write every trial, the summary and the machine")
    parser.add_argument("--markdown", default=None, metavar="MD", help="write the summary as a Markdown table")
    parser.add_argument("--workdir", default=None, metavar="DIR",
                        help="where the scratch runs go (default: a temporary directory, removed after)")
    parser.add_argument("--steps", type=int, default=40, help="train.steps of every run (default 40)")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="train.timeout_s of every run (default 10: at 5 s a rank starved by a loaded 2-core "
                             "machine timed out even in the uninterrupted reference run)")


def _machine() -> dict[str, Any]:
    import torch

    return {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(), "loadavg_start": list(os.getloadavg())}


def _run_trial(setup: Setup, ref: Any, rng: random.Random, kind: str, trial: int, seed: int) -> dict[str, Any]:
    """One trial; an exception in the harness is recorded (the trial's columns stay n/a), not fatal."""
    rec = empty_record(kind, trial, seed)
    t0 = time.monotonic()
    try:
        TRIALS[kind](setup, ref, rng, rec)
    except Exception as exc:  # a harness failure is a result to report, not a crash of the campaign
        rec["note"] += f"harness error: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    rec["trial_s"] = round(time.monotonic() - t0, 1)
    print(f"[{kind} {trial}] " + json.dumps({k: v for k, v in rec.items() if k not in ("report", "note")}),
          flush=True)
    return rec


def _campaign(args: argparse.Namespace, workdir: Path, result: dict[str, Any]) -> None:
    """The reference run, then every kind's trials in order (one RNG for all); ``result`` is filled in and
    written out after every trial (``"complete": false`` until the end), so an interrupted campaign keeps data."""
    setup = Setup(workdir=workdir, steps=args.steps, timeout_s=args.timeout_s)
    t0 = time.monotonic()
    ref, failures = run_reference(setup)
    print(f"reference: {len(ref.losses)} steps in {ref.total_s:.1f} s; fault window {ref.window_s:.2f} s", flush=True)
    result.update({"setup": {"steps": setup.steps, "ckpt_every": setup.ckpt_every, "kill_in_save_ckpt_every": 1,
                             "keep_checkpoints": setup.keep, "timeout_s": setup.timeout_s, "nproc": setup.nproc,
                             "train_argv": setup.train_argv(Path("RUN"))[2:]},
                   "reference": {"steps": len(ref.losses), "total_s": round(ref.total_s, 2),
                                 "window_s": round(ref.window_s, 3),
                                 "step_s": round(ref.step_s, 4), "final_loss": ref.losses.get(setup.steps),
                                 "failed_attempts": failures},
                   "trials": [], "complete": False})
    rng = random.Random(args.seed)
    for kind in args.kinds:
        for i in range(args.trials):
            result["trials"].append(_run_trial(setup, ref, rng, kind, i, args.seed))
            result["summary"] = summarize(result["trials"], args.kinds)
            result["campaign_s"] = round(time.monotonic() - t0, 1)
            _write(args, result)
    result["complete"] = True


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The JSON (``--out``) and Markdown (``--markdown``) files of ``result`` so far."""
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.markdown and "summary" in result:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(markdown(result["summary"]))


def main(args: argparse.Namespace) -> int:
    if args.trials < 1 or args.steps < 8:
        print(f"{_PROG}: error: --trials must be >= 1 and --steps >= 8", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"command": shlex.join(["python", _PROG, *sys.argv[1:]]), "seed": args.seed,
                              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                              "machine": _machine()}
    if args.workdir:
        _campaign(args, Path(args.workdir).resolve(), result)
    else:
        with tempfile.TemporaryDirectory(prefix="shardwise-faults-") as tmp:
            _campaign(args, Path(tmp), result)
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    print_table(result["summary"], f"{_PROG}: seed {args.seed}, {args.trials} trial(s) per kind, "
                                   f"{result['campaign_s']:.0f} s")
    _write(args, result)
    return 0


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog=f"python {_PROG}", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
