"""The one harness every torchrun benchmark shares (``shardwise bench comm|sbp|dp|tp|zero|pp``).

A benchmark module provides ``add_arguments`` (which calls ``add_launch_arguments``), a ``validate(args)`` that
raises ``ValueError`` with the fix, and a ``worker(args) -> int`` that is one rank of the job. ``run_bench``
validates in the launching process (a bad flag is one line, exit 2, before any rank starts), then either is
the worker (``--worker``) or starts ``-n`` local ranks that re-run the same module with the same flags plus
``--worker`` — so any torchrun job (multi-node too) can run a worker directly:
``torchrun ... -m shardwise.bench.dp --worker ...``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["add_launch_arguments", "run_bench", "worker_argv", "paired_ratio", "write_json"]

_SKIP = {"help", "nproc", "worker", "_bench_parser"}


def add_launch_arguments(parser: argparse.ArgumentParser, *, nproc: int = 2, what: str = "local ranks") -> None:
    """``-n/--nproc`` and the hidden ``--worker``; remembers the parser so the workers get the same flags."""
    parser.add_argument("-n", "--nproc", type=int, default=nproc, help=f"{what} (default {nproc})")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(_bench_parser=parser)


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The flags that reproduce ``args`` under the parser that made them, plus ``--worker``. Pure."""
    parser: argparse.ArgumentParser = args._bench_parser
    argv = ["--worker"]
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        if action.dest in _SKIP or not action.option_strings:
            continue
        value = getattr(args, action.dest, None)
        # the longest spelling: torchrun's own parser would take a bare ``--max`` for its ``--max-restarts``
        names = [o for o in action.option_strings
                 if not (isinstance(action, argparse.BooleanOptionalAction) and o.startswith("--no-"))]
        flag = max(names, key=len)
        argv += _flag_words(action, flag, value)
    return argv


def _flag_words(action: argparse.Action, flag: str, value: Any) -> list[str]:
    if value is None or value is argparse.SUPPRESS:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag[2:]]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return [flag] if value != action.default else []
    if isinstance(value, (list, tuple)):
        return [flag, ",".join(str(v) for v in value)]
    return [flag, str(value)]


def run_bench(name: str, args: argparse.Namespace, *, validate: Callable[[argparse.Namespace], object],
              worker: Callable[[argparse.Namespace], int], prog: str | None = None, module: str | None = None) -> int:
    """Validate, then be one rank (``--worker``) or launch ``args.nproc`` local ranks of ``module`` (default
    ``shardwise.bench.NAME``). ``prog`` names the command in error lines (default ``shardwise bench NAME``)."""
    try:
        if args.nproc < 1:
            raise ValueError(f"-n/--nproc must be >= 1, got {args.nproc}; e.g. -n 2")
        validate(args)
    except ValueError as exc:
        print(f"{prog or f'shardwise bench {name}'}: error: {exc}", file=sys.stderr)
        return 2
    if args.worker:
        return worker(args)
    from ..runtime.launch import run_local

    return run_local(args.nproc, [module or f"shardwise.bench.{name}", *worker_argv(args)], module=True)


def paired_ratio(rounds: Sequence[Sequence[float]], ref: Sequence[Sequence[float]] | None) -> float:
    """Median over rounds of (this variant's median step / the reference's median step in the same round):
    rounds interleave the variants, so a machine that slows down mid-run slows both sides of each pair."""
    if ref is None:
        return 0.0
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(rounds, ref))


def write_json(path: str | Path, data: Any) -> None:
    """Results as indented JSON (rank 0 calls it)."""
    Path(path).write_text(json.dumps(data, indent=1))
