"""``python benchmarks/planner_published.py --search``: the search on Megatron-LM's Table 1 rows (model, GPU
count and batch fixed, everything else free) against the paper's own layout, and the search time on GPT-3 175B at
1,024 / 4,096 / 16,384 devices. Pure: nothing runs but the planner.

Two spaces per row: ``free`` (every strategy the planner knows, ZeRO included) and ``megatron-2021`` (what the
paper's Megatron-LM had: no ZeRO). Both use ``runtime="megatron"`` and bf16-mixed, as the paper's predictions do.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from shardwise.planner import Hardware
from shardwise.planner.enumerate import Space
from .published import MEGATRON_TABLE1, megatron_prediction, megatron_spec
from shardwise.planner.search import search

__all__ = ["search_row", "search_published", "search_speed", "published_search_lines"]

SPACES = {"free": Space(precision="bf16-mixed"),
          "megatron-2021": Space(precision="bf16-mixed", zero_stages=(0,), pipeline_zero_stages=(0,),
                                 context_parallel=(1,))}


def _why(paper: Any, ours: Any) -> str:
    """The step-time terms that moved most between the paper's layout and ours (seconds per step)."""
    diffs = {k: ours.breakdown[k] - paper.breakdown.get(k, 0.0) for k in ours.breakdown}
    moved = sorted(diffs, key=lambda k: diffs[k])[:2]
    parts = [f"{k} {diffs[k]:+.2f} s" for k in moved if diffs[k] < 0]
    return ", ".join(parts) or "same costs"


def search_row(row: Any, hw: Hardware) -> dict[str, Any]:
    """One Table 1 row: the paper's layout predicted, and the search's first choice in each space."""
    spec = megatron_spec(row.layers, row.hidden, row.heads)
    paper = megatron_prediction(row, hw)
    out: dict[str, Any] = {"params_b": row.params_b, "gpus": row.gpus, "batch": row.batch,
                           "published_tflops": row.tflops, "paper_layout": paper.plan.describe(),
                           "paper_predicted_tflops": paper.tflops_per_device}
    for name, space in SPACES.items():
        start = time.perf_counter()
        result = search(spec, hw, devices=row.gpus, global_batch=row.batch, runtime="megatron", space=space, top=1)
        best = result.best
        out[name] = {"layout": best.plan.describe(), "plan": best.plan.to_json(),
                     "predicted_tflops": best.tflops_per_device, "step_time_s": best.step_time_s,
                     "memory_gb": best.memory.total / 1e9, "search_s": time.perf_counter() - start,
                     "at_least_as_fast": best.step_time_s <= paper.step_time_s * (1 + 1e-9),
                     "why": _why(paper, best)}
    return out


def search_published(hw: Hardware | None = None) -> list[dict[str, Any]]:
    hw = hw or Hardware.preset("a100-80g-sxm")
    return [search_row(row, hw) for row in MEGATRON_TABLE1]


def search_speed(hw: Hardware | None = None, sizes: tuple[int, ...] = (1024, 4096, 16384),
                 repeats: int = 3) -> list[dict[str, Any]]:
    """Search time for GPT-3 175B (batch 1536) on ``sizes`` devices, one core, full space: CPU seconds of this
    process (whatever else the machine runs), the median of ``repeats`` cold searches — the schedule caches
    emptied before each, as in a fresh process — after one warm-up search of another model (imports)."""
    from shardwise.planner import flush_sim, pipeline_cost

    hw = hw or Hardware.preset("a100-80g-sxm")
    spec = megatron_spec(96, 12288, 96)
    search(megatron_spec(24, 2304, 24), hw, devices=32, global_batch=512, runtime="megatron", space=SPACES["free"],
           top=3)
    out = []
    for n in sizes:
        cpu, wall = [], []
        for _ in range(repeats):
            pipeline_cost._SCHEDULE_CACHE.clear()
            flush_sim._COMPILED.clear()
            start, t0 = time.perf_counter(), time.process_time()
            result = search(spec, hw, devices=n, global_batch=1536, runtime="megatron", space=SPACES["free"], top=3)
            cpu.append(time.process_time() - t0)
            wall.append(time.perf_counter() - start)
        out.append({"devices": n, "search_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
                    "cpu_s_runs": cpu, "candidates": result.candidates, "evaluated": result.evaluated,
                    "best": result.best.plan.describe(), "best_tflops": result.best.tflops_per_device})
    return out


def published_search_lines(rows: list[dict[str, Any]], speed: list[dict[str, Any]]) -> list[str]:
    lines = ["| params | GPUs | batch | paper's layout | its predicted TF/s | search (free) | TF/s | "
             "search (Megatron-2021: no ZeRO) | TF/s | why ours is faster (free) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f, m = r["free"], r["megatron-2021"]
        lines.append(f"| {r['params_b']}B | {r['gpus']} | {r['batch']} | {r['paper_layout']} | "
                     f"{r['paper_predicted_tflops']:.1f} | {f['layout']} | {f['predicted_tflops']:.1f} | {m['layout']} | "
                     f"{m['predicted_tflops']:.1f} | {f['why']} |")
    ok = all(r[s]["at_least_as_fast"] for r in rows for s in SPACES)
    lines += ["", f"First choice predicted at least as fast as the paper's layout on every row: "
                  f"{'yes' if ok else 'NO'}.", "",
              "| devices | search CPU s (one core, median of 3 cold runs) | runs | wall s | layouts | predicted | "
              "first choice | TF/s |",
              "|---|---|---|---|---|---|---|---|"]
    for s in speed:
        runs = ", ".join(f"{x:.2f}" for x in s.get("cpu_s_runs", [s["cpu_s"]]))
        lines.append(f"| {s['devices']:,} | {s['cpu_s']:.2f} | {runs} | {s['search_s']:.2f} | {s['candidates']:,} | "
                     f"{s['evaluated']} | "
                     f"{s['best']} | {s['best_tflops']:.1f} |")
    return lines
