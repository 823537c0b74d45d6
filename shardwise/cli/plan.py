"""``shardwise plan``: the fastest layouts of a model on N devices that fit, before anything runs.

    shardwise plan --preset gpt-small --parallel.nproc 8 --hardware a100-80g-sxm
    shardwise plan --model.n_layer 96 --model.n_embd 12288 --model.n_head 96 --model.block_size 2048 \\
        --parallel.nproc 1024 --data.global_batch 1536 --train.precision bf16 --hardware a100-80g-sxm \\
        --pin parallel.tp=8 --top 5 --explain

Model and batch flags are ``shardwise train``'s; ``--parallel.nproc`` is the device count. ``--pin FIELD=VALUE``
(repeatable) fixes a ``parallel`` field (or ``modules.NAME=replicate``: keep a module whole on every
tensor-parallel rank); other ``--parallel.*`` layout flags are ignored by the search. Without ``--hardware`` it
plans for this machine as ``shardwise train`` would (its calibration, else a quick probe) and says so in one
line on stderr. The plans are those ``shardwise train`` runs, each with its error band; plans whose step times
differ by less than the faster one's band are a tie, and the recommended plan (``planner.error_band.recommend``:
the simplest of those tied with the fastest, what ``--parallel.auto`` runs) is printed as the whole ``shardwise
train`` command line that runs it as priced: the flags given here that train reads (model, data, train,
optimizer, non-layout parallel ones), the global batch, a pinned precision and the plan's layout
(``train_command``). ``--json`` prints, on stdout alone, ``{"plans": [{"plan": {...}, "prediction": {...}, "error_band":
{...}, "tie": bool, "train_command": "..."}], "recommended": i, "search_s": ...}``. Bad input: one error line, exit
code 2.
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

    from ..runtime.config import load_config
    from ..runtime.config_defaults import search_batch
    from ..runtime.planning import RECOMMEND_POOL, parse_pins, pins_from_flags, plan_config
    from .predict import hardware_for
    from .train import config_overrides

    if args.top < 1:
        raise ValueError(f"--top {args.top} must be >= 1")
    overrides = {k: v for k, v in config_overrides(args).items() if not _layout_key(k) or k == "parallel.nproc"}
    cfg = load_config(path=args.config, preset=args.preset, overrides=overrides)
    devices = cfg.parallel.nproc
    if devices < 1:
        raise ValueError(f"parallel.nproc = {devices}: give the number of devices to plan for, e.g. --parallel.nproc 8")
    pairs = parse_pins(args.pin)
    precision = pairs.pop("precision", None)
    if precision is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    pins = pins_from_flags(pairs)
    cfg = search_batch(cfg, devices, pins)  # an unset global batch, for the largest dp the pins allow
    hw = hardware_for(args, cfg, "plan")
    # at least --parallel.auto's pool: both recommend among the same plans (planning.RECOMMEND_POOL)
    result, fields = plan_config(cfg, hw, devices=devices, pins=pins, top=max(args.top, RECOMMEND_POOL),
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
    from ..planner.error_band import ranked

    shown = shown_plans(result, hw, args.top)
    if args.json:
        tie = tied_with_fastest(result, hw)
        plans = [{"plan": {**fields[i], "nproc": cfg.parallel.nproc}, "planner_plan": result[i].plan.to_json(),
                  "prediction": {**result[i].to_json(), "devices": cfg.parallel.nproc,
                                 "global_batch": cfg.data.global_batch, "seq_len": cfg.model.block_size},
                  "error_band": _band_json(hw, result[i]), "tie": i in tie,
                  "train_command": train_command(args, cfg, fields[i])} for i in shown]
        out = {"plans": plans, "recommended": shown.index(ranked(result.predictions, hw)[0]),
               "search_s": result.search_s, "candidates": result.candidates,
               "evaluated": result.evaluated, "hardware": hw.name, "devices": cfg.parallel.nproc}
        if args.explain:
            out["pruned"] = result.to_json()["pruned"]
        print(json.dumps(out))
        return 0
    best = ranked(result.predictions, hw)[0]
    _print(cfg, hw, result, shown, train_command(args, cfg, fields[best]), explain=args.explain)
    return 0


def shown_plans(result: Any, hw: Any, top: int) -> list[int]:
    """Indices of the plans ``shardwise plan`` shows: the search's first ``top``, and the recommended one after
    them where it ranks below (a simpler plan tied with the fastest)."""
    from ..planner.error_band import ranked

    head = list(range(min(top, len(result))))
    best = ranked(result.predictions, hw)[0]
    return head + ([best] if best not in head else [])


def tied_with_fastest(result: Any, hw: Any) -> set[int]:
    """Indices of the plans the model cannot tell from the fastest (the fastest included when any other is)."""
    from ..planner.error_band import ties

    group = ties(result.predictions, hw)[0]
    if len(group) < 2:
        return set()
    return {i for i, p in enumerate(result.predictions) if any(p is q for q in group)}


def _band_json(hw: Any, pred: Any) -> dict[str, Any] | None:
    from ..planner.error_band import error_band

    band = error_band(hw, pred.plan)
    return band.to_json() if band is not None else None


_NOT_LAYOUT = ("algorithm", "calibration", "bucket_cap_mb")
"""``parallel`` fields that are no part of a layout: given to ``plan``, they go to ``train`` as given."""


def _layout_key(key: str) -> bool:
    """A ``parallel.*`` key the plan decides (or ``nproc``/``auto``, which the printed command sets itself)."""
    return key.startswith("parallel.") and key.removeprefix("parallel.") not in _NOT_LAYOUT


def _text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)


def train_overrides(args: argparse.Namespace, cfg: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """The ``--section.field`` flags with which ``shardwise train`` builds the config ``cfg`` (the planned one:
    model, batch, precision) laid out as ``fields``: the flags given to ``plan`` that train reads but the
    layout, the priced global batch, a precision pinned with ``--pin train.precision=``, and the plan's
    ``parallel`` fields where they differ from what the preset / config file would give."""
    from ..runtime.config import load_config
    from .train import config_overrides

    out = {k: v for k, v in config_overrides(args).items() if not _layout_key(k)}
    base = load_config(path=args.config, preset=args.preset, overrides=out)
    if base.train.precision != cfg.train.precision:
        out["train.precision"] = cfg.train.precision
    out["data.global_batch"] = cfg.data.global_batch  # always: the batch is what the plan was priced for
    if base.parallel.auto:  # a config file's auto would search again on the launch machine
        out["parallel.auto"] = False
    for key, value in fields.items():
        if getattr(base.parallel, key) != value:
            out[f"parallel.{key}"] = value
    out["parallel.nproc"] = cfg.parallel.nproc
    return out


def train_command(args: argparse.Namespace, cfg: Any, fields: dict[str, Any]) -> str:
    """``shardwise train ...``: the command line that runs one plan as it was priced (quoted for a POSIX
    shell); ``shardwise train`` parses it into the same config (tests/unit/test_plan_command.py checks it)."""
    import shlex

    head = [f"--config {shlex.quote(args.config)}"] if args.config else []
    head += [f"--preset {args.preset}"] if args.preset else []
    flags = [f"--{key} {shlex.quote(_text(value))}" for key, value in train_overrides(args, cfg, fields).items()]
    return " ".join(["shardwise train", *head, *flags])


def why_lost(best: Any, other: Any, tolerance: float | None = None, band: str = "") -> str:
    """Why ``other`` ranks below ``best``: the breakdown term that costs it the most time; a tie when the slower
    exceeds the faster by less than ``tolerance`` of the faster (default the search's ``TIE``; ``shardwise plan``
    passes the error band's typical error, named ``band``): the simpler ranks first; more machinery when it is
    faster by more."""
    from ..planner.search import TIE, simplicity

    tolerance = TIE if tolerance is None else tolerance
    diffs = {k: other.breakdown.get(k, 0.0) - best.breakdown.get(k, 0.0) for k in other.breakdown}
    term = max(diffs, key=lambda k: diffs[k])
    gap = other.step_time_s / best.step_time_s - 1
    fast, slow = sorted((best.step_time_s, other.step_time_s))
    if slow - fast < tolerance * fast:
        simpler = simplicity(best.plan) < simplicity(other.plan)
        within = f"the {band} band" if band else f"the planner's {tolerance:.1%}"
        return (f"a tie ({gap:+.2%} step time, within {within}); "
                + ("the first uses less machinery (pipeline, ZeRO stage, recomputation, schedule, tp)" if simpler
                   else "the first is predicted faster by less than that"))
    if gap < 0:
        return (f"predicted {-gap:.2%} faster, but with more machinery (pipeline, ZeRO stage, recomputation, "
                f"schedule, tp), each piece of which must save {TIE:.1%} of the step to rank first")
    return f"{gap:+.2%} step time, most of it {term} (+{diffs[term]:.3g} s)"


def tie_line(result: Any, hw: Any) -> str | None:
    """``"tie within the ±5.5 % band: chose the simpler <layout> over <fastest> (predicted 1.2 % faster)"`` when
    the recommended plan is not the fastest; None when it is."""
    from ..planner.error_band import ranked, tie_tolerance

    best = result[ranked(result.predictions, hw)[0]]
    fastest = min(result, key=lambda p: p.step_time_s)
    if fastest is best or fastest.step_time_s == best.step_time_s:
        return None
    band, gap = tie_tolerance(hw, fastest.plan) * 100, (best.step_time_s / fastest.step_time_s - 1) * 100
    return (f"tie within the ±{band:.1f} % band: chose the simpler {best.plan.describe()} over "
            f"{fastest.plan.describe()} (predicted {gap:.1f} % faster)")


def _runner_up(result: Any, hw: Any) -> str | None:
    """The line on the plan ranked after the recommended one, with the tolerance of the faster of the two."""
    from ..planner.error_band import error_band, ranked, tie_tolerance

    order = ranked(result.predictions, hw)
    if len(order) < 2:
        return None
    best, other = result[order[0]], result[order[1]]
    faster = min((best, other), key=lambda p: p.step_time_s)
    band = error_band(hw, faster.plan)
    why = why_lost(best, other, tie_tolerance(hw, faster.plan), band.short() if band is not None else "")
    return f"runner-up ({other.plan.describe()}) lost: {why}"


def _print(cfg: Any, hw: Any, result: Any, shown: list[int], command: str, *, explain: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..planner.error_band import error_band, ranked
    from ..planner.units import format_bytes
    from .predict import step_time_text

    console = Console()
    table = Table(title=f"shardwise plan: {result[0].model} ({result[0].params_text()} parameters), "
                        f"{cfg.parallel.nproc} × {hw.name}, global batch "
                        f"{cfg.data.global_batch} (searched {result.candidates:,} layouts, predicted "
                        f"{result.evaluated}, {result.search_s:.2f} s)")
    best, tie = ranked(result.predictions, hw)[0], tied_with_fastest(result, hw)
    if tie or best != 0:
        table.caption = "→ the recommended plan; = tied with the fastest (inside its error band)"
    for col in ("#", "plan", "step s", "TF/s/dev", "MFU", "memory / device", "dominant"):
        table.add_column(col, justify="left" if col in ("plan", "dominant") else "right")
    for i in shown:
        p, band = result[i], error_band(hw, result[i].plan)
        table.add_row(("→" if i == best else "") + str(i + 1) + ("=" if i in tie else ""), p.plan.describe(),
                      f"{p.step_time_s:.4g} " + (band.short() if band is not None else "±?"),
                      f"{p.tflops_per_device:.1f}", f"{p.mfu:.1%}",
                      f"{format_bytes(p.memory.total, 2)} / {format_bytes(p.memory.capacity)}", p.dominant)
    console.print(table)
    lines = [f"run the best: {command}", tie_line(result, hw), f"its step time: {step_time_text(hw, result[best])}",
             _runner_up(result, hw)]
    for line in lines:
        if line is not None:
            console.print(line, highlight=False, soft_wrap=True, markup=False)
    if explain:
        pruned = Table(title="pruned regions")
        for col in ("reason", "layouts", "example"):
            pruned.add_column(col, justify="right" if col == "layouts" else "left")
        for region in result.pruned:
            pruned.add_row(escape(region.reason), f"{region.count:,}", escape(region.example))
        console.print(pruned)
