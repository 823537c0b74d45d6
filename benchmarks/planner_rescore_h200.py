"""The H200 single-device measurements re-predicted with this code (nothing runs on a GPU).

    python benchmarks/planner_rescore_h200.py

The six layouts of a 124M GPT measured on one H200 (``benchmarks/single_device_h200.json``, from
``benchmarks/device_check.sh``) against the planner fed (a) that H200's calibration
(``benchmarks/hardware_h200_1gpu.json``) and (b) each of the three quick probes ``shardwise train`` ran there
(``benchmarks/quick_probe_h200.json``). Prints each layout's error and the median and worst |error|, so a change
to the cost model is scored on measurements already taken.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root makes ``shardwise`` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardwise.bench.planner_device import GPT2_SMALL_FLAGS, SINGLE_LAYOUTS  # noqa: E402
from shardwise.planner import Hardware, predict  # noqa: E402
from shardwise.runtime.config import load_config, parse_overrides  # noqa: E402
from shardwise.runtime.prediction import gpt_spec, plan_from_config, probed_hardware  # noqa: E402

BENCH = Path(__file__).resolve().parent


def layout_errors(hw: Hardware, rows: list[dict], global_batch: int | None = None) -> dict[str, float]:
    flags = dict(SINGLE_LAYOUTS)
    out = {}
    for row in rows:
        argv = GPT2_SMALL_FLAGS.split() + flags[row["layout"]] + ["--parallel.nproc", "1"]
        cfg = load_config(overrides=parse_overrides(argv))
        pred = predict(gpt_spec(cfg), plan_from_config(cfg, train_passes=True), hw,
                       global_batch=global_batch or cfg.data.global_batch,
                       fused_optimizer=False)  # the stored rows ran torch's unfused (foreach) AdamW
        out[row["layout"]] = pred.step_time_s / row["measured_s"] - 1
    return out


def _line(name: str, errors: dict[str, float]) -> str:
    worst = max(errors, key=lambda k: abs(errors[k]))
    med = statistics.median(abs(e) for e in errors.values())
    return (f"{name}: median |error| {med:.1%}, worst {errors[worst]:+.1%} ({worst}); "
            + ", ".join(f"{k} {v:+.1%}" for k, v in errors.items()))


def calibrated_rows() -> dict[str, float]:
    """Each stored layout's error with the H200's calibration."""
    rows = json.loads((BENCH / "single_device_h200.json").read_text())["single_device"]
    return layout_errors(Hardware.load(BENCH / "hardware_h200_1gpu.json"), rows)


def probe_rows() -> list[dict[str, float]]:
    """Each stored layout's error with each quick probe's hardware (one dict per probe)."""
    probes = json.loads((BENCH / "quick_probe_h200.json").read_text())
    out = []
    for run in probes["quick_probe_runs"]:
        measured = {k: v for k, v in run.items() if k not in ("wall_s",)}
        measured["rows"] = [tuple(r) for r in measured["rows"]]
        measured["bf16_rows"] = [tuple(r) for r in measured["bf16_rows"]]
        out.append(layout_errors(probed_hardware(**measured), probes["single_device"], 16))
    return out


def main() -> int:
    print(_line("H200 calibration", calibrated_rows()))
    for i, errors in enumerate(probe_rows(), 1):
        print(_line(f"quick probe {i}", errors))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
