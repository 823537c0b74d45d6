"""A pipeline step's measured timeline: every rank's compute actions with their host-clock times, gathered along
the pipeline axis, and the Chrome/Perfetto trace written from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ... import comm
from .actions import Action
from .simulate import Event

__all__ = ["measured_timeline", "write_trace"]


def measured_timeline(pipe: Any) -> list[Event]:
    """The last step's compute actions on every pipeline rank, measured: seconds from the earliest start.

    Host clock (``time.perf_counter``): ranks on one machine share it; across machines the offsets are
    not aligned. Collective along the pipeline axis (one all-gather); every rank gets every event.
    """
    if not pipe.last_events:
        raise ValueError("pipe.timeline() reports the last step's actions, but no step has run yet; call "
                         "pipe.step(inputs, targets) first (on every rank)")
    kinds = ("F", "B", "W")
    rows = torch.tensor([[a.stage, kinds.index(a.kind), a.microbatch, t0, t1] for a, t0, t1 in pipe.last_events],
                        dtype=torch.float64).reshape(-1, 5).to(pipe.mesh.device)
    sizes = [sum(1 for a in acts if a.is_compute) for acts in pipe.schedule.ranks]
    if pipe.mesh.size(pipe.axis) > 1:
        rows = comm.all_gather(rows, pipe.mesh, pipe.axis, dim=0, sizes=sizes)  # type: ignore[assignment]
    rows = rows.cpu()
    origin = float(rows[:, 3].min()) if rows.numel() else 0.0
    owners = [r for r, n in enumerate(sizes) for _ in range(n)]
    return [Event(rank, Action(int(s), kinds[int(k)], int(mb)), float(t0) - origin, float(t1) - origin)  # type: ignore[arg-type]
            for rank, (s, k, mb, t0, t1) in zip(owners, rows.tolist())]


def write_trace(pipe: Any, path: str | Path) -> list[Event]:
    """Write the last step's measured timeline as a Chrome/Perfetto trace (JSON trace-event format, one
    thread per pipeline rank; open in chrome://tracing or ui.perfetto.dev). Collective along the axis;
    pipeline coordinate 0 writes the file. Returns the events (``timeline_plot.plot_timeline`` draws them)."""
    events = measured_timeline(pipe)
    if pipe.mesh.coord(pipe.axis) == 0:
        trace = [{"name": str(e.action), "cat": e.action.kind, "ph": "X", "pid": 0, "tid": e.rank,
                  "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
                  "args": {"stage": e.action.stage, "microbatch": e.action.microbatch}} for e in events]
        trace += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"pp rank {r}"}}
                  for r in range(pipe.mesh.size(pipe.axis))]
        Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    return events
