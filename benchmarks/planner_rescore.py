"""A stored ``shardwise bench planner --measured`` campaign re-predicted with this code (nothing is trained).

    python benchmarks/planner_rescore.py benchmarks/planner_measured.json \
        --hardware benchmarks/hardware_cpu_2ranks.json,benchmarks/hardware_cpu_4ranks.json [--markdown FILE] [--json FILE]

``--hardware``: the campaign's calibration files, comma-separated; each layout is predicted with the one measured
at its rank count. The measurement is kept as stored (``benchmarks/planner/rescore.py``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root makes ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.planner.rescore import rescore  # noqa: E402
from shardwise.bench.planner import write_outputs  # noqa: E402

__all__ = ["add_arguments", "main"]

PROG = "benchmarks/planner_rescore.py"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("rescore", metavar="JSON", help="the --json FILE of a `shardwise bench planner --measured` run")
    parser.add_argument("--hardware", required=True, help="the campaign's calibration files, comma-separated")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="also write the table as markdown")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")


def main(args: argparse.Namespace) -> int:
    """Bad input (a ``ValueError``) is one line on stderr and exit code 2."""
    try:
        lines, data = rescore(args)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    write_outputs(args, lines, data)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog=f"python {PROG}", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
