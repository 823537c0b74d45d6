"""The measured tables of the one check (``published_check.py``): our own runs, re-predicted with this code from
what was stored when they ran (nothing runs here; pure apart from reading the stored JSON files).

* ``h200-calibrated``: six layouts of a 124M GPT on one H200 (``benchmarks/single_device_h200.json``) against the
  planner fed that H200's calibration (``benchmarks/hardware_h200_1gpu.json``); step time.
* ``h200-quick-probe``: the same six layouts against each of the three quick probes ``shardwise train`` ran there
  (``benchmarks/quick_probe_h200.json``: no calibration, what a first launch gets); step time.
* ``cpu-calibrated``: the 15-layout campaign on the 2-core CPU machine (``benchmarks/planner_measured.json``, 2 and
  4 ranks, each with its rank count's calibration); step time.
* ``cpu-memory``: the whole-run peak per rank of 31 ``shardwise train`` runs on that machine
  (``benchmarks/memory_measured_cpu.json``) against the planner's launch prediction (``predict`` of the run's
  validated config, as the launcher prints it); memory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable

BENCH = Path(__file__).resolve().parents[1]

__all__ = ["measured_tables", "h200_calibrated", "h200_quick_probe", "cpu_calibrated", "cpu_memory"]

Family = Callable[..., str]


def h200_calibrated() -> list[tuple[str, float]]:
    from benchmarks.planner_rescore_h200 import calibrated_rows

    return list(calibrated_rows().items())


def h200_quick_probe() -> list[tuple[str, float]]:
    from benchmarks.planner_rescore_h200 import probe_rows

    return [(f"probe {i}: {name}", e) for i, errors in enumerate(probe_rows(), 1) for name, e in errors.items()]


def cpu_calibrated() -> list[tuple[str, float, dict[str, int]]]:
    """``(layout, step-time error, its axes)`` of the stored CPU campaign."""
    from shardwise.bench.planner_measured import layout_config

    from .rescore import rescore

    args = argparse.Namespace(rescore=str(BENCH / "planner_measured.json"),
                              hardware=f"{BENCH / 'hardware_cpu_2ranks.json'},{BENCH / 'hardware_cpu_4ranks.json'}")
    out = []
    for r in rescore(args)[1]["measured"]:
        p = layout_config(r["layout"]).parallel
        out.append((r["layout"], r["predicted_s"] / r["measured_s"] - 1, {"tp": p.tp, "pp": p.pp}))
    return out


def cpu_memory() -> list[tuple[str, float, dict[str, int]]]:
    """``(run, memory error, its axes)``: the launch prediction of each stored run's config against its peak."""
    from shardwise.bench.memory import parse_layout
    from shardwise.planner import Hardware, predict
    from shardwise.runtime.config import load_config, parse_overrides, validate
    from shardwise.runtime.prediction import gpt_spec, plan_from_config

    hw = Hardware.load(BENCH / "hardware_cpu_4ranks.json")
    out = []
    for row in json.loads((BENCH / "memory_measured_cpu.json").read_text())["rows"]:
        _, flags = parse_layout(row["layout"])
        cfg = validate(load_config(overrides=parse_overrides(row["flags"] + flags)), launch=True)
        plan = plan_from_config(cfg, train_passes=True)
        pred = predict(gpt_spec(cfg), plan, hw, global_batch=cfg.data.global_batch)
        out.append((f"{row['group']}: {row['layout']}", pred.memory.total / 2**20 / row["measured_mib"] - 1,
                    {"tp": plan.tp, "pp": plan.pp}))
    return out


def measured_tables(family: Family) -> dict[str, list[tuple[str, float, str]]]:
    """``{table: [(row, signed error, layout family)]}`` of every measured table (module doc)."""
    single = family(tp=1, pp=1)  # one device: the H200 rows
    return {
        "h200-calibrated": [(name, e, single) for name, e in h200_calibrated()],
        "h200-quick-probe": [(name, e, single) for name, e in h200_quick_probe()],
        "cpu-calibrated": [(name, e, family(**axes)) for name, e, axes in cpu_calibrated()],
        "cpu-memory": [(name, e, family(**axes)) for name, e, axes in cpu_memory()],
    }
