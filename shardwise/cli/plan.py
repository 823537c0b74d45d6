"""``shardwise plan``: the fastest layouts of a model on N devices that fit, before anything runs.

    shardwise plan --preset gpt-small --parallel.nproc 8 --hardware a100-80g-sxm
    shardwise plan --model.n_layer 96 --model.n_embd 12288 --model.n_head 96 --model.block_size 2048 \\
        --parallel.nproc 1024 --data.global_batch 1536 --train.precision bf16 --hardware a100-80g-sxm \\
        --pin parallel.tp=8 --top 5 --explain

Model and batch flags are ``shardwise train``'s; ``--parallel.nproc`` is the device count. ``--pin FIELD=VALUE``
(repeatable) fixes a ``parallel`` field (or ``modules.NAME=replicate``: keep a module whole on every
tensor-parallel rank); other ``--parallel.*`` flags are ignored by the search. The plans are those
``shardwise train`` runs; each is printed with the ``--parallel.*`` flags that run it. ``--json`` prints,
on stdout alone, ``{"plans": [{"plan": {...}, "prediction": {...}}], "search_s": ...}``. Bad input: one error
line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .predict import add_hardware_arguments
    from .train import add_config_arguments

    add_hardware_arguments(parser)
    parser.add_argument("--pin", action="append", default=[], metavar="FIELD=VALUE",
                        help="fix a field, e.g. parallel.tp=8, parallel.pp_schedule=1f1b, modules.wte=replicate "
                             "(repeatable)")
    parser.add_argument("--top", type=int, default=3, metavar="K", help="plans to show (default 3)")
    parser.add_argument("--memory-margin", type=float, default=0.1, metavar="F",
                        help="fraction of device memory kept free (default 0.1)")
    parser.add_argument("--explain", action="store_true", help="also show the pruned regions and why")
    parser.add_argument("--json", action="store_true", help="print one JSON object (and nothing else) on stdout")
    add_config_arguments(parser)


def run_search(args: argparse.Namespace) -> tuple[Any, Any, Any, list[dict[str, Any]]]:
    """``(config, hardware, search result, train fields per plan)``; ``ValueError`` for bad input."""
    import dataclasses

    import torch

    from ..runtime.config import load_config
    from ..runtime.planning import parse_pins, pins_from_flags, plan_config
    from ..runtime.prediction import resolve_hardware
    from .train import config_overrides

    if args.top < 1:
        raise ValueError(f"--top {args.top} must be >= 1")
    overrides = {k: v for k, v in config_overrides(args).items() if not k.startswith("parallel.")
                 or k in ("parallel.nproc",)}
    cfg = load_config(path=args.config, preset=args.preset, overrides=overrides)
    devices = cfg.parallel.nproc
    if devices < 1:
        raise ValueError(f"parallel.nproc = {devices}: give the number of devices to plan for, e.g. --parallel.nproc 8")
    pairs = parse_pins(args.pin)
    precision = pairs.pop("precision", None)
    if precision is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    hw = resolve_hardware(args.hardware, device="cuda" if torch.cuda.is_available() else "cpu", nproc=devices,
                          devices_per_node=args.devices_per_node)
    result, fields = plan_config(cfg, hw, devices=devices, pins=pins_from_flags(pairs), top=args.top,
                                 memory_margin=args.memory_margin)
    return cfg, hw, result, fields


def main(args: argparse.Namespace) -> int:
    from ..planner.search import NoFeasiblePlan

    try:
        cfg, hw, result, fields = run_search(args)
    except NoFeasiblePlan as exc:
        print(f"shardwise plan: error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:
        message = str(exc).splitlines()[0] if str(exc).strip() else repr(exc)
        print(f"shardwise plan: error: {message}", file=sys.stderr)
        return 2
    if args.json:
        plans = [{"plan": {**f, "nproc": cfg.parallel.nproc}, "planner_plan": p.plan.to_json(),
                  "prediction": {**p.to_json(), "devices": cfg.parallel.nproc, "global_batch": cfg.data.global_batch,
                                 "seq_len": cfg.model.block_size}}
                 for f, p in zip(fields, result)]
        out = {"plans": plans, "search_s": result.search_s, "candidates": result.candidates,
               "evaluated": result.evaluated, "hardware": hw.name, "devices": cfg.parallel.nproc}
        if args.explain:
            out["pruned"] = result.to_json()["pruned"]
        print(json.dumps(out))
        return 0
    _print(cfg, hw, result, fields, explain=args.explain)
    return 0


def flags(fields: dict[str, Any]) -> str:
    """The ``--parallel.*`` flags of one plan (defaults left out)."""
    defaults = {"pp_schedule": "1f1b", "pp_chunks": 1, "pp_microbatches": 0, "pp_split": (), "zero_stage": 0,
                "activation_checkpointing": False, "grad_accum": 0, "replicate": ()}
    parts = []
    for key, value in fields.items():
        if defaults.get(key, object()) == value:
            continue
        text = ",".join(value) if isinstance(value, tuple) else str(value).lower() if isinstance(value, bool) else value
        parts.append(f"--parallel.{key} {text}")
    return " ".join(parts)


def why_lost(best: Any, other: Any) -> str:
    """The breakdown term that costs ``other`` the most time relative to ``best``."""
    from ..planner.search import TIE

    diffs = {k: other.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0) for k in other.breakdown}
    term = max(diffs, key=lambda k: diffs[k])
    gap = other.step_time_s / best.step_time_s - 1
    if abs(gap) <= TIE * 4:
        return (f"a tie ({gap:+.2%} step time, within the model's resolution); the first uses less machinery "
                f"(pipeline, ZeRO stage, recomputation, schedule)")
    return f"{gap:+.1%} step time, most of it {term} (+{diffs[term]:.3g} s)"


def _print(cfg: Any, hw: Any, result: Any, fields: list[dict[str, Any]], *, explain: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(title=f"shardwise plan: {result[0].model}, {cfg.parallel.nproc} × {hw.name}, global batch "
                        f"{cfg.data.global_batch} (searched {result.candidates:,} layouts, predicted "
                        f"{result.evaluated}, {result.search_s:.2f} s)")
    for col in ("#", "plan", "step s", "TF/s/dev", "MFU", "memory GB", "dominant"):
        table.add_column(col, justify="left" if col in ("plan", "dominant") else "right")
    for i, p in enumerate(result, 1):
        table.add_row(str(i), p.plan.describe(), f"{p.step_time_s:.4g}", f"{p.tflops_per_device:.1f}", f"{p.mfu:.1%}",
                      f"{p.memory.total / 1e9:.2f} / {p.memory.capacity / 1e9:.0f}", p.dominant)
    console.print(table)
    console.print(f"run the best: shardwise train {flags(fields[0])} --parallel.nproc {cfg.parallel.nproc}",
                  highlight=False, soft_wrap=True)
    if len(result) > 1:
        console.print(f"runner-up ({result[1].plan.describe()}) lost: {why_lost(result[0], result[1])}",
                      highlight=False, soft_wrap=True)
    if explain:
        pruned = Table(title="pruned regions")
        for col in ("reason", "layouts", "example"):
            pruned.add_column(col, justify="right" if col == "layouts" else "left")
        for region in result.pruned:
            pruned.add_row(region.reason, f"{region.count:,}", region.example)
        console.print(pruned)
