"""``shardwise verify``: does the requested layout train to the same losses as one process?

Takes the same flags as ``shardwise train``. Runs the first ``--steps`` (or ``--train.steps``; default 8) steps twice — once on a single
process (dp = tp = 1, no ZeRO; the same global batch through more accumulation steps) and once on the
requested layout — prints both losses side by side and exits 1 when any step differs by more than
``atol + rtol·|reference|``. Same seed → same weights and same samples per step (the sampler's order does not
depend on the layout), so only floating-point summation order may differ. A mixture of experts' layout
(``--parallel.ep``) is compared with one process holding every expert. Pipeline layouts (``--parallel.pp``,
with dp, tp inside the stages, ZeRO-1, activation checkpointing) are compared with the same single process
(pp = 1, the pipeline fields reset).

Precision: both runs use the config's ``train.precision``. In bf16 (autocast) the layouts round at other places
than one process does (partial sums over dp/tp shards), so they agree only to bf16's noise: the default tolerance
is then ``rtol`` 4e-3 ≈ 2^-8, one bf16 rounding of the loss (fp32: 1e-4).

Note: Adam normalises each gradient by its own running scale, so a bug that scales every gradient by a
constant (e.g. summing instead of averaging over dp) barely moves Adam's losses; use ``--optimizer.name sgd``
to make such bugs visible.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from ..runtime.config import Config, DebugConfig, validate
from ..runtime.metrics import read_metrics
from ..runtime.run_lock import RunLock
from .train import add_config_arguments, config_overrides, launch, train_config, write_config

__all__ = ["add_arguments", "main", "compare_losses", "TOLERANCES"]

DEFAULT_STEPS = 8
"""Steps compared when neither ``--steps`` nor ``--train.steps`` is given (a config file's ``train.steps`` is the
length of a training run, not of a check)."""

TOLERANCES = {"fp32": (1e-4, 1e-5), "bf16": (4e-3, 1e-5), "bf16-mixed": (1e-2, 1e-5)}
"""``train.precision`` -> default ``(rtol, atol)`` per step. bf16: 2^-8 ≈ 3.9e-3 relative is one rounding of the loss
to bf16's 8 significant bits; the layouts' measured gap is far smaller (docs/training.md), a real bug far larger."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None,
                        help=f"steps to compare (= --train.steps; default {DEFAULT_STEPS}, whatever a config file says)")
    parser.add_argument("--rtol", type=float, default=None,
                        help="relative tolerance per step (default 1e-4; 4e-3 with --train.precision bf16)")
    parser.add_argument("--atol", type=float, default=None, help="absolute tolerance per step (default 1e-5)")
    add_config_arguments(parser)


def _configs(args: argparse.Namespace) -> tuple[Config, Config, Path]:
    overrides = config_overrides(args)
    cfg = train_config(args, overrides)  # named as train names it
    args.steps = _steps(args.steps, cfg.train.steps if "train.steps" in overrides else None)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=args.steps, ckpt_every=0))
    layout = validate(cfg)
    # one process runs the layout's batch, whatever the defaults would derive for it (config_defaults.py)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, global_batch=layout.data.global_batch))
    # the pipeline fields need pp > 1, sequence parallelism and async tensor parallelism tp > 1
    single = dataclasses.replace(cfg.parallel, nproc=1, dp=1, tp=1, pp=1, cp=1, ep=1, zero_stage=0, grad_accum=0,
                                 sequence_parallel=False, async_tp=False, pp_microbatches=0, pp_chunks=1,
                                 pp_split=())
    eager = dataclasses.replace(cfg.train, compile=False)  # train.compile: compiled layout vs eager one process
    reference = validate(dataclasses.replace(cfg, parallel=single, train=eager, debug=DebugConfig()))  # same precision
    rtol, atol = TOLERANCES[cfg.train.precision]
    args.rtol = rtol if args.rtol is None else args.rtol
    args.atol = atol if args.atol is None else args.atol
    # scratch runs beside the run, never inside it (it may hold checkpoints, or be training): runs/verify-NAME
    root = cfg.run_dir().with_name(f"verify-{cfg.run_dir().name}")
    return (dataclasses.replace(reference, train=dataclasses.replace(reference.train, out_dir=str(root / "reference"))),
            dataclasses.replace(layout, train=dataclasses.replace(layout.train, out_dir=str(root / "layout"))), root)


def _steps(steps: int | None, given: int | None) -> int:
    """The steps to compare: ``--steps`` or ``--train.steps`` (``given``; the same if both), else ``DEFAULT_STEPS``."""
    if steps is not None and given is not None and steps != given:
        raise ValueError(f"--steps {steps} and --train.steps {given} disagree; give one of them")
    n = steps if steps is not None else given if given is not None else DEFAULT_STEPS
    if n < 1:
        raise ValueError(f"--steps = {n} must be >= 1; e.g. --steps {DEFAULT_STEPS}")
    return n


def compare_losses(reference: list[float], layout: list[float], *, rtol: float, atol: float) -> list[bool]:
    """Per step: ``|layout − reference| <= atol + rtol·|reference|``. Pure."""
    return [abs(b - a) <= atol + rtol * abs(a) for a, b in zip(reference, layout)]


def _describe(cfg: Config) -> str:
    p = cfg.parallel
    zero = f", ZeRO-{p.zero_stage}" if p.zero_stage else ""
    zero += ", sequence parallel" if p.sequence_parallel else ""
    zero += ", async tp" if p.async_tp else ""
    ckpt = f", {p.activation_checkpointing} activation checkpointing" if p.activation_checkpointing != "none" else ""
    cp = f" × cp={p.cp}" if p.cp > 1 else ""
    cp += f" (experts over ep={p.ep})" if p.ep > 1 else ""
    ckpt += ", bf16 autocast" if cfg.train.precision == "bf16" else ""
    ckpt += f", compiled ({cfg.train.compile_backend})" if cfg.train.compile else ""
    if p.pp > 1:
        return (f"pp={p.pp} × dp={p.dp}{cp} × tp={p.tp}{zero}{ckpt}, {p.pp_schedule}, micro {p.micro_batch} × accum "
                f"{p.grad_accum} in {p.pp_microbatches} pipeline micro-batches")
    return f"dp={p.dp}{cp} × tp={p.tp}{zero}{ckpt}, micro {p.micro_batch} × accum {p.grad_accum}"


def main(args: argparse.Namespace) -> int:
    try:
        reference, layout, root = _configs(args)
    except ValueError as exc:
        print(f"shardwise verify: error: {exc}", file=sys.stderr)
        return 2
    lock = RunLock(root, prog="shardwise verify")  # two verifies of one run would share their scratch runs
    try:
        lock.acquire()
    except ValueError as exc:  # another command holds it
        print(f"shardwise verify: error: {exc}", file=sys.stderr)
        return 2
    try:
        return _compare(args, reference, layout)
    finally:
        lock.release()


def _compare(args: argparse.Namespace, reference: Config, layout: Config) -> int:
    losses: list[list[float]] = []
    for name, cfg in (("reference", reference), ("layout", layout)):
        run_dir = Path(cfg.train.out_dir)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        write_config(cfg, run_dir)
        print(f"shardwise verify: {name}: {cfg.parallel.nproc} process(es), {_describe(cfg)}", flush=True)
        rc = launch(cfg, run_dir, None, save=False)
        if rc != 0:
            print(f"shardwise verify: the {name} run failed (exit code {rc}); see its output above", file=sys.stderr)
            return rc
        losses.append([r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")])
    return _report(losses[0], losses[1], args, layout)


def _report(ref: list[float], lay: list[float], args: argparse.Namespace, layout: Config) -> int:
    from rich.console import Console
    from rich.table import Table

    ok = compare_losses(ref, lay, rtol=args.rtol, atol=args.atol)
    table = Table(title=f"shardwise verify: 1 process vs {_describe(layout)}")
    for col in ("step", "1 process", "layout", "|diff|", ""):
        table.add_column(col, justify="right")
    for i, (a, b, good) in enumerate(zip(ref, lay, ok), start=1):
        table.add_row(str(i), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}", "ok" if good else "[red]DIFFERS[/red]")
    Console().print(table)
    if len(ref) != len(lay) or len(ref) != args.steps:
        print(f"shardwise verify: FAILED: got {len(ref)} reference and {len(lay)} layout losses, expected {args.steps}",
              file=sys.stderr)
        return 1
    if not all(ok):
        first = ok.index(False) + 1
        print(f"shardwise verify: FAILED: losses differ beyond atol={args.atol:g} + rtol={args.rtol:g}·|loss| from "
              f"step {first} on; this layout does not compute what one process computes", file=sys.stderr)
        return 1
    print(f"shardwise verify: OK: {len(ref)} steps agree within atol={args.atol:g} + rtol={args.rtol:g}·|loss|")
    return 0
