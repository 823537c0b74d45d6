"""``shardwise predict``: what a training config will cost — step time, throughput, memory per device — on
given hardware, before anything runs (the planner, ``shardwise.planner``; nothing is started or written).

    shardwise predict --preset gpt-small --parallel.nproc 8 --parallel.tp 2 --hardware a100-80g-sxm
    shardwise predict --config run.toml --parallel.nproc 1024 --hardware my-cluster.json --json

The flags are ``shardwise train``'s (``--preset``, ``--config``, ``--section.field VALUE``), checked the same
way except for what only a launch on this machine needs; ``parallel.nproc`` is the device count. With
pp > 1, ``parallel.micro_batch`` is one pipeline micro-batch (Megatron's reading; see
``plan_from_config`` in ``shardwise/runtime/prediction.py``). A plan that does not fit in memory is not an
error: ``fits`` is false and the largest memory term is named. The step time comes with its error band
(``shardwise.planner.error_band``: the planner's errors on published and measured rows of the same hardware class
and layout family). Bad input: one error line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

__all__ = ["add_arguments", "add_hardware_arguments", "hardware_for", "main", "run_prediction", "step_time_text"]


def add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """``--hardware`` and ``--devices-per-node`` (``shardwise predict`` and ``shardwise plan``)."""
    parser.add_argument("--hardware", default=None, metavar="NAME|FILE",
                        help="a preset (a100-80g-sxm, h100-80g-sxm, h200-141g-sxm) or a calibration file of `shardwise calibrate` "
                             "(default, as shardwise train: parallel.calibration, else this machine's calibration for "
                             "parallel.nproc ranks, else a quick probe of this machine; one line says which)")
    parser.add_argument("--devices-per-node", type=int, default=None, metavar="N",
                        help="devices per node (default: the hardware's own)")


def hardware_for(args: argparse.Namespace, cfg: Any, command: str) -> Any:
    """The hardware ``--hardware`` names; without it what ``shardwise train`` would run on here for
    ``parallel.nproc`` ranks (``parallel.calibration``, this machine's calibration, else the quick probe of
    well under a second), with one line on stderr saying which and how to pin one. ``ValueError``, one line."""
    import dataclasses

    import torch

    from ..planner import PRESETS
    from ..runtime.prediction import launch_hardware, resolve_hardware

    device = "cuda" if torch.cuda.is_available() else "cpu"
    nproc = cfg.parallel.nproc
    if args.hardware is not None or (args.devices_per_node is not None and args.devices_per_node < 1):
        return resolve_hardware(args.hardware, device=device, nproc=nproc, devices_per_node=args.devices_per_node)
    if nproc < 1:
        raise ValueError(f"parallel.nproc = {nproc}: give the number of devices, e.g. --parallel.nproc 8")
    if cfg.parallel.calibration:  # train's own check of the field: a bad file is one line naming it
        resolve_hardware(cfg.parallel.calibration, device=device, nproc=nproc)
    try:
        hw, where = launch_hardware(cfg, device=device, nproc=nproc)
    except (OSError, TypeError, KeyError, ValueError) as exc:
        raise ValueError(f"the calibration of this machine cannot be read ({type(exc).__name__}: {exc}); "
                         f"regenerate it with `shardwise calibrate`, or pass --hardware NAME") from None
    if args.devices_per_node is not None:
        hw = dataclasses.replace(hw, devices_per_node=args.devices_per_node)
    print(f"shardwise {command}: no --hardware given: {nproc} ranks of this machine as shardwise train sees them, "
          f"from its {where}; pin one with --hardware NAME ({', '.join(sorted(PRESETS))}) or --hardware "
          f"calibration.json", file=sys.stderr, flush=True)
    return hw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from .train import add_config_arguments

    add_hardware_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object (and nothing else) on stdout")
    add_config_arguments(parser)


def run_prediction(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(validated config, hardware, prediction)``; ``ValueError`` (one line) for every bad input."""
    from ..planner import predict
    from ..runtime.config import load_config, validate
    from ..runtime.prediction import gpt_spec, plan_from_config
    from .train import config_overrides

    cfg = validate(load_config(path=args.config, preset=args.preset, overrides=config_overrides(args)), launch=False)
    hw = hardware_for(args, cfg, "predict")
    plan = plan_from_config(cfg)
    return cfg, hw, predict(gpt_spec(cfg), plan, hw, global_batch=cfg.data.global_batch)


def main(args: argparse.Namespace) -> int:
    try:
        cfg, hw, pred = run_prediction(args)
    except ValueError as exc:
        message = str(exc).splitlines()[0] if str(exc).strip() else repr(exc)
        print(f"shardwise predict: error: {message}", file=sys.stderr)
        return 2
    if args.json:
        from ..planner import error_band

        band = error_band(hw, pred.plan)
        out = {**pred.to_json(), "devices": cfg.parallel.nproc, "global_batch": cfg.data.global_batch,
               "seq_len": cfg.model.block_size, "error_band": band.to_json() if band is not None else None}
        print(json.dumps(out))
    else:
        _print_tables(cfg, hw, pred)
    return 0


def step_time_text(hw: Any, pred: Any) -> str:
    """``"1.43 s, typically within ±5.5 % (worst …)"``: the step time with the error band of its hardware class and
    layout family (``shardwise.planner.error_band``); the bare time where nothing is known about the class."""
    from ..planner import error_band

    band = error_band(hw, pred.plan)
    if band is None:
        return f"{pred.step_time_s:.3g} s (no published or measured rows of this hardware: error unknown)"
    return band.describe(pred.step_time_s)


def _summary_rows(cfg: Any, hw: Any, pred: Any) -> list[tuple[str, str]]:
    from ..planner.units import format_bytes

    mem, plan = pred.memory, pred.plan
    m = plan.microbatches if plan.pp > 1 else 1
    unit = ("flush" if plan.pp > 1 else "pass") + ("es" if plan.grad_accum != 1 else "")
    batch = (f"{cfg.data.global_batch} × {cfg.model.block_size} tokens = dp {plan.dp} × {plan.grad_accum} {unit} × "
             + (f"{m} micro-batches × " if plan.pp > 1 else "") + f"micro-batch {plan.micro_batch}")
    fits = (f"yes: {format_bytes(mem.total)} of {format_bytes(mem.capacity)}" if mem.fits
            else f"NO: {format_bytes(mem.total)} > {format_bytes(mem.capacity)}; largest term: {mem.largest} "
                 f"({format_bytes(getattr(mem, mem.largest))})")
    return [("devices", f"{cfg.parallel.nproc} × {hw.name} ({hw.devices_per_node} per node)"),
            ("model", f"{pred.params_text()} parameters"), ("plan", plan.describe()), ("global batch", batch),
            ("step time", f"{step_time_text(hw, pred)}; dominant: {pred.dominant}"),
            ("tokens/s", f"{pred.tokens_per_s:,.0f}"), ("TF/s per device", f"{pred.tflops_per_device:.1f}"),
            ("MFU", f"{pred.mfu:.1%}"), ("fits", fits + f" (pipeline rank {mem.rank})")]


def _stage_label(layers: list[str]) -> str:
    return layers[0] if len(layers) == 1 else f"{layers[0]} … {layers[-1]} ({len(layers)})"


def _print_tables(cfg: Any, hw: Any, pred: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from ..planner.units import format_bytes

    console = Console()
    head = Table(title=f"shardwise predict: {pred.model}, {cfg.model.n_layer} layers, n_embd {cfg.model.n_embd}",
                 show_header=False)
    for k, v in _summary_rows(cfg, hw, pred):
        head.add_row(k, v)
    console.print(head)
    mem = pred.memory
    memory = Table(title="memory per device (the most loaded pipeline rank)")
    for col in ("term", "bytes", "share"):
        memory.add_column(col, justify="left" if col == "term" else "right")
    terms = {"params": mem.params, "grads": mem.grads, "optimizer": mem.optimizer, "activations": mem.activations,
             "buffers": mem.buffers}
    for name, value in terms.items():
        marker = "  ← largest" if name == mem.largest else ""
        memory.add_row(name + marker, format_bytes(value, 2), f"{value / max(mem.training, 1):.0%}")
    memory.add_row("training peak", format_bytes(mem.training, 2), "")
    memory.add_row("construction (build, load)" + ("  ← largest" if mem.largest == "construction" else ""),
                   format_bytes(mem.construction, 2), "")
    memory.add_row("total (the larger)", format_bytes(mem.total, 2), f"of {format_bytes(mem.capacity)}")
    time_ = Table(title="time per step")
    for col in ("term", "s", "%"):
        time_.add_column(col, justify="left" if col == "term" else "right")
    for name, value in pred.breakdown.items():
        time_.add_row(name, f"{value:.4g}", f"{value / pred.step_time_s:.1%}")
    time_.add_row("step", f"{pred.step_time_s:.4g}", "100%")
    console.print(memory, time_)
    stages = Table(title="pipeline stages: seconds per micro-batch (F forward, B input grad, W weight grad)")
    for col in ("stage", "pp rank", "layers", "F ms", "B ms", "W ms"):
        stages.add_column(col, justify="left" if col == "layers" else "right")
    for st in pred.stages:  # stage s runs on pipeline rank s % pp (interleaved: several chunks per rank)
        stages.add_row(str(st["stage"]), str(st["stage"] % pred.plan.pp), _stage_label(st["layers"]),
                       f"{st['F_s'] * 1e3:.3g}",
                       f"{st['B_s'] * 1e3:.3g}", f"{st['W_s'] * 1e3:.3g}")
    console.print(stages)
