"""Is the layout search's choice good, measured on this machine? (4 CPU ranks; a campaign of tens of minutes.)

    python benchmarks/planner_search_measured.py --hardware benchmarks/hardware_cpu_4ranks.json \
        [--steps N] [--repeats R] [--models a,b] [--markdown FILE] [--json FILE]

Three models, the plans the search ranks, a fixed set of them trained and timed, and the verdict per model:
``benchmarks/planner/search.py``. ``--hardware`` takes ``shardwise calibrate`` files, comma-separated (the one
measured at 4 ranks is used).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root makes ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.planner.search import add_search_arguments, search_measured  # noqa: E402
from shardwise.bench.planner import run_layout, write_outputs  # noqa: E402

__all__ = ["add_arguments", "main"]

PROG = "benchmarks/planner_search_measured.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hardware", default=None, help="calibration FILE(s) of `shardwise calibrate`, comma-separated")
    parser.add_argument("--steps", type=int, default=12, help="training steps per plan (default 12)")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables as markdown")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    add_search_arguments(parser)  # --repeats, --models


def main(args: argparse.Namespace) -> int:
    """Bad input (a ``ValueError``) is one line on stderr and exit code 2."""
    try:
        lines, data = search_measured(args, run_layout=run_layout)  # GPT plans train as bench planner's layouts do
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    write_outputs(args, lines, data)
    return 0


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog=f"python {PROG}", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
