"""``shardwise bench planner``: the planner's predictions against what this machine measures.

``--measured --hardware FILE``: trains every layout of ``LAYOUTS`` (data, tensor and pipeline parallelism,
ZeRO, recomputation on 2 and 4 ranks) briefly with ``shardwise train`` (one subprocess each, the layouts one
after another on an otherwise idle machine), reads each run's per-rank summaries (median step time; model
states + the saved-tensor high-water mark per rank), predicts the same layout with the calibration ``FILE``
(``shardwise calibrate``) and prints both, the errors, and the Kendall τ of the two rankings.
``--single-device``: the same on one accelerator, layout by layout (``planner_device``).
``--markdown FILE`` / ``--json FILE`` write the tables / the rows.

The published tables (Megatron-LM, Korthikanti et al., Narayanan et al.) and the campaigns that validate the
layout search live outside the package, in ``benchmarks/`` (``python benchmarks/planner_published.py``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .planner_measured import LAYOUTS, MODEL, kendall_tau, layout_config, measured_table, measurement_agreement, predict_layout

__all__ = ["add_arguments", "main", "run_layout", "LAYOUTS", "MODEL", "kendall_tau", "measurement_agreement",
           "layout_config", "measured_table"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--measured", action="store_true", help="train every layout briefly and compare")
    parser.add_argument("--single-device", action="store_true",
                        help="one accelerator: train micro-batch/accumulation/checkpointing/precision layouts of a "
                             "124M GPT with --parallel.nproc 1 and compare with each --hardware (presets or files)")
    parser.add_argument("--model-flags", default=None,
                        help="--single-device: shardwise train model/data flags replacing the GPT-2 small shape")
    parser.add_argument("--hardware", default=None, help="calibration FILE(s) (shardwise calibrate) or presets, "
                        "comma-separated: with --measured each layout uses the one measured at its nproc")
    parser.add_argument("--steps", type=int, default=12, help="training steps per measured layout (default 12)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="--measured: rounds per layout, median over them (default 1)")
    parser.add_argument("--only", default="", help="comma-separated layout names (default: all)")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables as markdown")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")


def run_layout(name: str, flags: list[str], steps: int, root: Path, calibration: str = "") -> dict[str, Any]:
    """Train one layout; ``calibration``: the file it is predicted with, given to the run as
    ``parallel.calibration`` (its collectives choose as the prediction assumes)."""
    out = root / name.replace(" ", "_")
    argv = [sys.executable, "-m", "shardwise.cli", "train", *MODEL, *flags, "--train.steps", str(steps),
            "--train.ckpt_every", "0", "--train.log_every", str(steps), "--train.out_dir", str(out)]
    if calibration:
        argv += ["--parallel.calibration", calibration]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"layout {name!r} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    ranks = [json.loads(f.read_text()) for f in sorted((out / "ranks").glob("rank*.json"))]
    step = statistics.median(r["step_s"] for r in ranks)
    mem = max(r.get("model_state_bytes", 0) + r.get("activation_peak_bytes", 0) for r in ranks)
    return {"step_s": step, "memory": mem, "config": json.loads((out / "config.json").read_text())}


def _measured(args: argparse.Namespace) -> tuple[list[str], dict[str, Any]]:
    from ..planner import Hardware
    from ..runtime.config import config_from_dict

    # one calibration per rank count when given (``--hardware a.json,b.json``): each layout is predicted with the
    # file measured at its own nproc, as ``shardwise train`` picks the local calibration of its nproc
    paths = [f.strip() for f in args.hardware.split(",") if f.strip()]
    files = [Hardware.resolve(f) for f in paths]
    by_ranks = {h.devices_per_node: h for h in files}
    file_of = {h.devices_per_node: str(Path(f).resolve()) for f, h in zip(paths, files) if Path(f).is_file()}
    wanted = {s.strip() for s in args.only.split(",") if s.strip()}
    chosen = [(name, flags) for name, flags in LAYOUTS if not wanted or name in wanted]
    rounds = max(1, getattr(args, "repeats", 1))
    # every round runs each layout once, in the same order: a slow spell of the machine touches every layout
    # of a round alike instead of one layout's every run; a layout's step is the median over the rounds
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in chosen}
    with tempfile.TemporaryDirectory(prefix="sw-bench-planner-") as tmp:
        for r in range(rounds):
            for name, flags in chosen:
                nproc = int(flags[flags.index("--parallel.nproc") + 1])
                got = run_layout(name, flags, args.steps, Path(tmp) / f"round{r}", file_of.get(nproc, ""))
                runs[name].append(got)
                print(f"round {r + 1}/{rounds} {name:18s} measured {got['step_s'] * 1e3:8.1f} ms", flush=True)
    rows = []
    for name, _ in chosen:
        got = runs[name][0]
        step = statistics.median(g["step_s"] for g in runs[name])
        cfg = config_from_dict(got["config"])
        seconds, pmem, dominant = predict_layout(cfg, by_ranks.get(cfg.parallel.nproc, files[0]))
        rows.append({"layout": name, "measured_s": step, "predicted_s": seconds,
                     "rounds_s": [g["step_s"] for g in runs[name]],
                     "measured_mem": got["memory"], "predicted_mem": pmem, "dominant": dominant})
        print(f"{name:18s} measured {step * 1e3:8.1f} ms  predicted {seconds * 1e3:8.1f} ms  "
              f"mem {got['memory'] / 2**20:7.1f} / {pmem / 2**20:7.1f} MiB", flush=True)
    return measured_table(rows), {"measured": rows}


def main(args: argparse.Namespace) -> int:
    """Bad input (a ``ValueError``) is one line on stderr and exit code 2, as for the other benches."""
    try:
        return _main(args)
    except ValueError as exc:
        print(f"shardwise bench planner: error: {exc}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    single = getattr(args, "single_device", False)
    if not (args.measured or single):
        raise ValueError("choose --measured and/or --single-device (with --hardware FILE from `shardwise calibrate`)")
    if args.measured and not args.hardware:
        raise ValueError("--measured needs --hardware FILE: run `shardwise calibrate --nproc 4 --out FILE` first")
    lines: list[str] = []
    data: dict[str, Any] = {}
    if args.measured:
        more, d = _measured(args)
        lines += more
        data.update(d)
    if single:
        from .planner_device import single_device

        more, d = single_device(args)
        lines += ([""] if lines else []) + more
        data.update(d)
    write_outputs(args, lines, data)
    return 0


def write_outputs(args: argparse.Namespace, lines: list[str], data: dict[str, Any]) -> None:
    """Print ``lines``; write them to ``args.markdown`` and ``data`` to ``args.json`` when given."""
    text = "\n".join(lines)
    print(text)
    if getattr(args, "markdown", None):
        Path(args.markdown).write_text(text + "\n")
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
