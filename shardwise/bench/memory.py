"""``shardwise bench memory``: each layout's whole-run peak against its memory floor, one table.

Trains a small GPT (``--layers``, ``--hidden``, ``--heads``, ``--vocab``, ``--seq``; ``--optimizer``,
``--precision``, ``--steps``) under every layout of ``--layouts`` with ``shardwise train`` (one subprocess each,
one after another) and reads each rank's ``memory_ledger`` (``runtime/memory_ledger.py``): the floor of the
layout (``planner/ledger.py``), the whole-run peak above the bare runtime, their ratio, the phase of the peak and
the biggest named excess — of the worst rank (highest ratio) — and the planner's prediction of the whole-run
peak (the launch's ``prediction`` record: the floor plus what the runtime adds) against the highest rank's
peak. A layout the runtime refuses shows its one-line error in its row; the others still run.

Layouts are named by their axes, joined by ``-``: ``dpN``, ``tpN``, ``ppN`` and ``zeroK`` (ZeRO stage K over
dp), e.g. ``zero3-dp2-tp2``; the rank count is the product of the axes. The default list (``default_layouts``,
``--nproc`` ranks, 4 by default): dp, ZeRO-1/2/3 over dp, tp, pp, pp 2 × dp, dp 2 × tp, ZeRO-3 dp 2 × tp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_arguments", "main", "parse_layout", "default_layouts", "layout_row", "run_layout", "render"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layouts", default="", help="comma-separated layouts, e.g. dp4,zero3-dp4,pp2-dp2 "
                        "(default: dp, ZeRO-1/2/3, tp, pp and hybrids over --nproc ranks)")
    parser.add_argument("--nproc", type=int, default=4, help="ranks of the default layouts (default 4)")
    parser.add_argument("--layers", type=int, default=4, help="GPT blocks (default 4)")
    parser.add_argument("--hidden", type=int, default=256, help="GPT width (default 256)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default 4)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary (default 256)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per pass and rank (default 2)")
    parser.add_argument("--optimizer", choices=("adamw", "sgd", "sgd-momentum"), default="adamw",
                        help="adamw (default), sgd (no momentum: no state), sgd-momentum (0.9)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "bf16-mixed"), default="fp32",
                        help="train.precision: fp32 (default), bf16 autocast over fp32 weights, or bf16-mixed (bf16 "
                             "weights, fp32 masters in ZeRO's shards: ZeRO layouts only)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per layout (default 3)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")


_AXES = {"dp": "--parallel.dp", "tp": "--parallel.tp", "pp": "--parallel.pp", "zero": "--parallel.zero_stage"}


def parse_layout(name: str) -> tuple[int, list[str]]:
    """``(ranks, shardwise train flags)`` of a layout name (module docstring). ``ValueError`` naming the part that
    is not an axis and a count. Pure."""
    sizes = {"dp": 1, "tp": 1, "pp": 1, "zero": 0}
    for part in name.strip().split("-"):
        axis = part.rstrip("0123456789")
        count = part[len(axis):]
        if axis not in sizes or not count:
            raise ValueError(f"layout {name!r}: {part!r} is not dpN, tpN, ppN or zeroK; write e.g. zero3-dp2-tp2")
        sizes[axis] = int(count)
    nproc = sizes["dp"] * sizes["tp"] * sizes["pp"]
    flags = ["--parallel.nproc", str(nproc)]
    for axis, value in sizes.items():
        if value != (0 if axis == "zero" else 1):
            flags += [_AXES[axis], str(value)]
    return nproc, flags


def default_layouts(nproc: int) -> list[str]:
    """The default list over ``nproc`` ranks (an even count for the hybrids; duplicates dropped). Pure."""
    half = max(1, nproc // 2)
    names = [f"dp{nproc}", f"zero1-dp{nproc}", f"zero2-dp{nproc}", f"zero3-dp{nproc}", f"tp{nproc}", f"pp{nproc}"]
    if nproc % 2 == 0 and nproc > 2:
        names += [f"pp2-dp{half}", f"dp2-tp{half}", f"zero3-dp2-tp{half}"]
    return list(dict.fromkeys(names))


def _model_flags(args: argparse.Namespace) -> list[str]:
    return ["--model.n_layer", str(args.layers), "--model.n_embd", str(args.hidden), "--model.n_head",
            str(args.heads), "--model.vocab_size", str(args.vocab), "--model.block_size", str(args.seq),
            "--data.global_batch", str(args.batch), "--parallel.micro_batch", str(args.micro_batch),
            "--optimizer.name", "adamw" if args.optimizer == "adamw" else "sgd", "--train.precision", args.precision,
            *(["--optimizer.beta1", "0" if args.optimizer == "sgd" else "0.9"] if args.optimizer != "adamw" else [])]


def run_layout(name: str, model_flags: list[str], steps: int, root: Path) -> dict[str, Any]:
    """Train layout ``name``: ``{"layout", "ranks": [rank summaries]}``, or ``{"layout", "error": one line}`` when
    the run is refused or fails (the last line it printed on stderr)."""
    try:
        _, flags = parse_layout(name)
    except ValueError as exc:
        return {"layout": name, "error": str(exc)}
    out = root / name
    argv = [sys.executable, "-m", "shardwise.cli", "train", *model_flags, *flags, "--train.steps", str(steps),
            "--train.ckpt_every", "0", "--train.log_every", str(steps), "--train.out_dir", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        lines = [line.strip() for line in proc.stderr.splitlines() if line.strip()]
        said = [line for line in lines if "error" in line.lower() or line.startswith("shardwise")]
        line = (said or lines or [f"exit {proc.returncode}"])[-1]
        return {"layout": name, "error": line.removeprefix("shardwise train: ").removeprefix("error: ")}
    ranks = [json.loads(f.read_text()) for f in sorted((out / "ranks").glob("rank*.json"))]
    return {"layout": name, "ranks": ranks, "predicted": _predicted_peak(out / "metrics.jsonl")}


def _predicted_peak(metrics: Path) -> float | None:
    """The planner's whole-run peak of the run's most loaded rank (its launch prediction), or None."""
    if not metrics.is_file():
        return None
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "prediction":
            return record.get("peak_memory_bytes")
    return None


def layout_row(run: dict[str, Any]) -> dict[str, Any]:
    """One table row from a ``run_layout`` result: the worst rank's (highest peak/floor) floor, peak above the
    bare runtime, ratio, phase of the peak and biggest named excess. Pure."""
    if "error" in run:
        return {"layout": run["layout"], "error": run["error"]}
    books = [(r["rank"], r.get("memory_ledger") or {}) for r in run["ranks"]]
    if not books:
        return {"layout": run["layout"], "error": "no rank wrote a summary"}
    rank, book = max(books, key=lambda rb: (rb[1].get("ratio") or 0.0, rb[1].get("whole_peak", 0)))
    floor = book.get("floor") or {}
    # the planner predicts the most loaded rank's whole-run peak (construction included): against the highest peak
    top = max((b.get("whole_peak") or 0 for _, b in books), default=0)
    predicted = run.get("predicted")
    error = predicted / top - 1 if predicted and top else None
    return {"layout": run["layout"], "rank": rank, "floor": floor.get("total"), "floor_largest": floor.get("largest"),
            "predicted": predicted, "highest_peak": top, "predicted_error": error,
            "floor_terms": floor, "peak": book.get("whole_peak"), "ratio": book.get("ratio"),
            "peak_phase": book.get("peak_phase"), "biggest_excess": book.get("biggest_excess"),
            "held": book.get("held_on_entry"),
            "phases": book.get("phases")}


def _mib(value: float | None) -> str:
    return f"{value / 2**20:.1f}" if isinstance(value, (int, float)) else "n/a"


def render(rows: list[dict[str, Any]], title: str) -> Any:
    """The rich table of ``rows`` (``layout_row``)."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("layout", "floor MiB (largest term)", "peak MiB above bare (worst rank)", "peak/floor",
                "predicted MiB (vs highest peak)", "phase of peak", "biggest named excess"):
        table.add_column(col)
    for r in rows:
        if "error" in r:
            table.add_row(r["layout"], f"refused: {r['error']}", "", "", "", "", "")
            continue
        excess = r.get("biggest_excess")
        error = r.get("predicted_error")
        table.add_row(r["layout"], f"{_mib(r['floor'])} ({r['floor_largest'] or 'n/a'})",
                      f"{_mib(r['peak'])} (r{r['rank']})", f"{r['ratio']:.2f}" if r.get("ratio") else "n/a",
                      f"{_mib(r.get('predicted'))} ({error:+.1%})" if error is not None else "n/a",
                      r.get("peak_phase") or "n/a",
                      (f"{_mib(excess[2])} MiB {excess[1]} ({excess[0]})" if excess else "none")
                      + (f"; {_mib(r['held'])} MiB held on entry" if r.get("held") else ""))
    return table


def main(args: argparse.Namespace) -> int:
    """Bad input (a ``ValueError``) is one line on stderr and exit code 2, as for the other benches."""
    from rich.console import Console

    names = [n.strip() for n in args.layouts.split(",") if n.strip()] or default_layouts(args.nproc)
    try:
        for name in names:
            parse_layout(name)
        if args.steps < 1:
            raise ValueError(f"--steps = {args.steps} must be >= 1")
    except ValueError as exc:
        print(f"shardwise bench memory: error: {exc}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="sw-bench-memory-") as tmp:
        for name in names:
            rows.append(layout_row(run_layout(name, _model_flags(args), args.steps, Path(tmp))))
            done = rows[-1]
            print(f"{name:16s} " + (f"refused: {done['error']}" if "error" in done else
                                    f"peak/floor {done['ratio']:.2f}" if done.get("ratio") else "no floor"), flush=True)
    title = (f"shardwise bench memory: GPT {args.layers} x {args.hidden}, vocabulary {args.vocab}, sequence "
             f"{args.seq}, {args.optimizer}, {args.precision}, {args.steps} steps")
    Console(width=None if sys.stdout.isatty() else 160).print(render(rows, title))  # a pipe: no wrapping at 80
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2, default=str) + "\n")
    return 0
