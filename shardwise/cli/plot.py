"""``shardwise plot RUN_DIR``: ``loss.png`` (loss and learning rate per step), ``throughput.png`` (tokens/s
and where a step's time goes) and, for a run with ``optimizer.clip_grad_norm``, ``grad_norm.png`` (the global
gradient norm before clipping) from the run's ``metrics.jsonl``. Needs matplotlib (``pip install matplotlib``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..runtime.metrics import read_metrics

__all__ = ["add_arguments", "main", "plot_run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: RUN_DIR)")


def plot_run(run_dir: Path, out: Path) -> list[Path]:
    """Write the PNGs; returns their paths. Raises ``ValueError`` without metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist; pass the directory of a shardwise train run")
    rows = read_metrics(path)
    if not rows:
        raise ValueError(f"{str(path)!r} holds no steps yet; plot after the run has trained at least one step")
    steps = [r["step"] for r in rows]
    out.mkdir(parents=True, exist_ok=True)  # only once there is something to draw: a failed plot writes nothing
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in rows], label="loss", color="tab:blue")
    evals = read_metrics(path, kind="eval")  # train.eval_every: the validation loss at its steps
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation loss",
                color="tab:red", markersize=3)
    ax.set_xlabel("step"), ax.set_ylabel("loss (nats/token)"), ax.set_title(f"{run_dir.name}: training loss")
    lr = ax.twinx()
    lr.plot(steps, [r["lr"] for r in rows], color="tab:gray", alpha=0.5, label="learning rate")
    lr.set_ylabel("learning rate")
    lines = ax.get_lines() + lr.get_lines()
    ax.legend(lines, [line.get_label() for line in lines], loc="upper right"), fig.tight_layout()
    loss_png = out / "loss.png"
    fig.savefig(loss_png, dpi=110), plt.close(fig)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, [r["tokens_per_s"] for r in rows], color="tab:green")
    top.set_ylabel("tokens/s"), top.set_title(f"{run_dir.name}: throughput")
    parts = ("fwd_s", "bwd_s", "opt_s", "comm_s", "overhead_s")
    bottom.stackplot(steps, *[[1e3 * r.get(k, 0.0) for r in rows] for k in parts], labels=[p[:-2] for p in parts])
    bottom.set_ylabel("ms per step"), bottom.set_xlabel("step"), bottom.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    tput_png = out / "throughput.png"
    fig.savefig(tput_png, dpi=110), plt.close(fig)
    norm_png = _plot_grad_norm(plt, run_dir.name, rows, out)
    return [loss_png, tput_png] + ([norm_png] if norm_png is not None else [])


def _plot_grad_norm(plt: Any, name: str, rows: list[dict[str, Any]], out: Path) -> Path | None:
    """``grad_norm.png``: the global gradient norm before clipping per step, for a run with
    ``optimizer.clip_grad_norm`` on (its steps log ``grad_norm``; a skipped step's is NaN, left as a gap); None
    for a run without clipping."""
    points = [(r["step"], r["grad_norm"]) for r in rows if "grad_norm" in r]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot([s for s, _ in points], [v for _, v in points], color="tab:red")
    ax.set_xlabel("step"), ax.set_ylabel("gradient norm (before clipping)")
    ax.set_title(f"{name}: global gradient norm"), fig.tight_layout()
    path = out / "grad_norm.png"
    fig.savefig(path, dpi=110), plt.close(fig)
    return path


def main(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        print("shardwise plot: needs matplotlib; install it with: pip install matplotlib  (or pip install "
              "'shardwise[plot]')", file=sys.stderr)
        return 2
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir
    try:
        paths = plot_run(run_dir, out)
    except ValueError as exc:
        print(f"shardwise plot: error: {exc}", file=sys.stderr)
        return 2
    print("shardwise plot: wrote " + ", ".join(str(p) for p in paths))
    return 0
