"""``shardwise schedule``: print a pipeline schedule, simulate it, and optionally plot its timeline.

    shardwise schedule --schedule zb-h1 -p 4 -m 8 --costs F=1,B=1,W=1,comm=0 --plot zb.png
    shardwise schedule --file my_schedule.txt          # one line of actions per rank; deadlocks reported

Costs are those of one rank's share of the model for one micro-batch; with ``--chunks`` > 1 each chunk
costs 1/chunks of them (so schedules with different chunk counts compare on the same model). A value can
be a list per stage separated by ``:`` (``F=1:2:1:1``), taken as per-stage (per-chunk) costs as given.
"""

from __future__ import annotations

import argparse
import sys

from ..parallel.pipeline.actions import Schedule, parse_schedule
from ..parallel.pipeline.communication import lower_communication
from ..parallel.pipeline.schedules import SCHEDULES, get_schedule
from ..parallel.pipeline.simulate import Costs, ScheduleDeadlock, simulate

__all__ = ["add_arguments", "main", "parse_costs"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", "-s", default="1f1b", help=f"one of: {', '.join(SCHEDULES)} (default 1f1b)")
    parser.add_argument("-p", type=int, default=4, help="pipeline ranks (default 4)")
    parser.add_argument("-m", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--chunks", type=int, default=1, help="model chunks per rank (interleaved; default 1)")
    parser.add_argument("--costs", default="F=1,B=1,W=1,comm=0",
                        help="F,B,W per micro-batch and comm per transfer, e.g. F=1,B=1,W=1,comm=0.1; "
                             "per-stage values with ':' (F=1:2:1:1). Non-split schedules run B+W as one backward")
    parser.add_argument("--file", default=None, help="read the schedule from a text file instead "
                        "(one rank per line: 'rank 0: 0F0 0F1 0B0 ...')")
    parser.add_argument("--comm", action="store_true", help="print the action lists with the send/receive "
                        "actions an executor runs (1SF0 = stage 1 sends forward output of micro-batch 0)")
    parser.add_argument("--grid", action="store_true", help="print the step x rank grid instead of rank lines")
    parser.add_argument("--plot", default=None, metavar="OUT.png", help="draw the simulated timeline (matplotlib)")


def parse_costs(text: str, chunks: int = 1) -> Costs:
    """``"F=1,B=2,W=1,comm=0.1"`` -> ``Costs``; scalar compute costs are divided by ``chunks``."""
    values: dict[str, float | tuple[float, ...]] = {}
    for item in filter(None, (t.strip() for t in text.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or key not in ("F", "B", "W", "comm"):
            raise ValueError(f"cannot read cost {item!r}: expected KEY=VALUE with KEY one of F, B, W, comm "
                             f"(e.g. --costs F=1,B=1,W=1,comm=0)")
        try:
            parts = tuple(float(v) for v in raw.split(":"))
        except ValueError:
            raise ValueError(f"cost {key} must be a number or ':'-separated numbers, got {raw!r}; e.g. --costs "
                             f"{key}=1 or {key}=1:2:1:1") from None
        values[key] = parts[0] if len(parts) == 1 else parts
    for key in ("F", "B", "W"):
        if chunks > 1 and isinstance(values.get(key), float):
            values[key] = values[key] / chunks  # type: ignore[operator]
    defaults = Costs().per_chunk(chunks)
    return Costs(F=values.get("F", defaults.F), B=values.get("B", defaults.B), W=values.get("W", defaults.W),
                 comm=values.get("comm", defaults.comm))


def main(args: argparse.Namespace) -> int:
    try:
        if args.file:
            with open(args.file, encoding="utf-8") as fh:
                schedule = parse_schedule(fh.read(), name=args.file, chunks=args.chunks)
        else:
            schedule = get_schedule(args.schedule, p=args.p, m=args.m, chunks=args.chunks)
        costs = parse_costs(args.costs, schedule.chunks)
        shown = _lowered(schedule) if args.comm else schedule
        print(shown.grid() if args.grid else shown.to_text())
        print()
        result = simulate(schedule, costs)
    except ScheduleDeadlock as exc:
        print(f"shardwise schedule: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if not args.file:
            raise
        print(f"shardwise schedule: error: cannot read --file {args.file!r} ({exc.strerror}); pass a text file with "
              f"one line of actions per rank, e.g. 'rank 0: 0F0 0F1 0B0 0B1'", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"shardwise schedule: error: {exc}", file=sys.stderr)
        return 2
    print(f"costs: F={costs.F} B={costs.B} W={costs.W} comm={costs.comm}"
          + (f" (per chunk: a rank's costs / {schedule.chunks})" if schedule.chunks > 1 else ""))
    print(result.summary())
    if args.plot:
        return _plot(result, args.plot)
    return 0


def _lowered(schedule: Schedule) -> Schedule:
    """The schedule with its sends and receives; a schedule that deadlocks has no simulated run to place the
    receives by, so it is shown with each receive just before its consumer (the deadlock is reported next)."""
    try:
        return lower_communication(schedule)
    except ScheduleDeadlock:
        return lower_communication(schedule, recv_ahead=0, recv_before_send=False)


def _plot(result, path: str) -> int:
    from ..bench.timeline_plot import plot_timeline

    s = result.schedule
    title = (f"{s.name}  p={s.p} m={s.m}" + (f" chunks={s.chunks}" if s.chunks > 1 else "")
             + f"   step time {result.makespan:.4g}   bubble {result.bubble_ratio:.1%}")
    try:
        plot_timeline(result.timeline, p=s.p, path=path, title=title, chunks=s.chunks,
                      split_backward=s.split_backward)
    except ImportError as exc:
        print(f"shardwise schedule: {exc}", file=sys.stderr)
        return 2
    print(f"timeline written to {path}")
    return 0
