"""The planner against every published and measured table (pure: nothing runs but the planner; about a minute).

    python benchmarks/planner_published.py [--search] [--markdown FILE] [--json FILE]

Megatron-LM Table 1 (TF/s per GPU), the GPT-3 175B training time, ZeRO Table 1 (model states), Korthikanti et
al. 2022 Table 5 and Narayanan et al. 2021 Table 2, all on the ``a100-80g-sxm`` preset, and Llama 3 405B
(Dubey et al. 2024 Table 4, context parallelism included) and Megatron-Core r0.8.0's weak-scaling table (with and
without ``Layout.async_tp``) on ``h100-80g-sxm`` (``benchmarks/planner/published_report.py``,
``benchmarks/planner/published_llama3.py``, ``benchmarks/planner/published_mcore.py``). ``--search``: also the layout search on Megatron-LM Table 1 against
the paper's layouts, and the search time (``benchmarks/planner/search_published.py``); ``--search-only``: that
alone. Starts with the one check (``benchmarks/planner/check_report.py``): every table in sample and held out
(leave-one-table-out), the fitted constants and the error bands. Writes the tables of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root makes ``benchmarks.*`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.planner.published_report import published_tables  # noqa: E402
from shardwise.bench.planner import write_outputs  # noqa: E402

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--search", action="store_true",
                        help="also the layout search on Megatron-LM Table 1 vs the paper's layouts, and search times")
    parser.add_argument("--search-only", action="store_true", help="only the layout search (no published tables)")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables as markdown")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--write-bands", action="store_true",
                        help="rewrite shardwise/planner/error_band.py's BANDS with the check's held-out bands")


def main(args: argparse.Namespace) -> int:
    lines: list[str] = []
    data: dict[str, Any] = {}
    if not args.search_only:
        from benchmarks.planner.check_report import check, check_lines

        result = check()
        if args.write_bands:
            from benchmarks.planner.check_report import write_bands

            print(f"wrote the error bands to {write_bands(result)}", file=sys.stderr)
        lines, data = published_tables()
        lines = check_lines(result) + [""] + lines
        data["check"] = {"in_sample": result["in_sample"], "held_out": result["held_out"], "how": result["how"],
                         "refit": result["refit"], "bands": [[*k, *v] for k, v in result["bands"].items()]}
    if args.search or args.search_only:
        from benchmarks.planner.search_published import published_search_lines, search_published, search_speed

        rows, speed = search_published(), search_speed()
        lines += ([""] if lines else []) + published_search_lines(rows, speed)
        data.update({"search_published": rows, "search_speed": speed})
    write_outputs(args, lines, data)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python benchmarks/planner_published.py",
                                      description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
