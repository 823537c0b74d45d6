"""``python benchmarks/planner_search_measured.py --hardware FILE``: is the layout search's choice good, measured here?

For three models on 4 CPU ranks — the reference GPT at two sizes (``shardwise train``) and a deep residual MLP
(``search_worker``, traced by ``ModelSpec.trace``, no tp plan) — with a memory per rank lowered below
what plain data parallelism needs for two of them:

1. ``search`` ranks every layout of the runnable space (``Space.runnable()``) under the budget: the planner's
   order; plans ``shardwise train`` refuses are listed and skipped, as ``--parallel.auto`` skips them.
2. The measured set: the planner's top 3, plus every plan that fits in two slices around its first choice —
   same micro-batch, no recomputation, any dp × tp × pp, ZeRO 0-3 (0-1 with a pipeline), schedules 1f1b and
   zb-h1; and same micro-batch, full recomputation, data parallel with ZeRO 0-3. Fixed rules, not picked by
   the result: they cover dp, tp (GPT), pp under two schedules, every ZeRO stage and checkpointing.
3. Each plan trains ``--steps`` steps (median after the first two, median over ranks; ``--repeats`` rounds,
   median over rounds), in a fixed shuffled order so that a drift in the machine's load does not follow
   the planner's ranking.
4. The verdict per model (``search_report``): first choice within 5 % of the best measured plan, and
   the best measured plan in the planner's top 3.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from shardwise.planner import Hardware, ModelSpec, Layout, Prediction, predict
from shardwise.planner.search import Space, search
from .search_report import model_lines, summary_lines, verdict
from .search_worker import MLPConfig, mlp_spec

__all__ = ["Case", "CASES", "add_search_arguments", "train_flags", "slices", "search_measured", "report_lines"]

DEVICES = 4




@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the campaign. ``model``: ``shardwise train`` overrides (GPT, on the ``gpt-small`` preset) or
    ``MLPConfig`` fields (MLP). ``memory_bytes``: the rank memory the planner gets (None: the calibration's)."""

    name: str
    kind: str
    model: dict[str, Any]
    global_batch: int
    memory_bytes: float | None = None
    description: str = ""


CASES: tuple[Case, ...] = (
    Case("gpt-6x256", "gpt", {"model.n_layer": 6}, 8, 90e6,
         "reference GPT, gpt-small widened to 6 blocks: 4.9M parameters, 256 tokens, batch 8"),
    Case("gpt-4x128", "gpt", {"model.n_layer": 4, "model.n_embd": 128}, 16, None,
         "reference GPT, 4 blocks of width 128: 0.9M parameters, 256 tokens, batch 16"),
    Case("mlp-8x512", "mlp", dataclasses.asdict(MLPConfig()), 128, 250e6,
         "deep residual MLP (non-transformer), 8 blocks 512→2048→512: 17.1M parameters, batch 128"),
)
"""Two GPT sizes and one MLP; the budgets of the first and the last rule out plain data parallelism."""


@dataclasses.dataclass(frozen=True)
class Slice:
    label: str
    pins: dict[str, Any]
    space: Space


def slices(first: Layout) -> tuple[Slice, ...]:
    """The fixed slices around the first choice that are measured besides the top 3 (module doc, step 2)."""
    mb = first.micro_batch
    layouts = Space(schedules=("1f1b", "zb-h1"), chunks=(2,), checkpointing=("none",), sequence_parallel=(False,))
    return (Slice(f"mb={mb}, no recomputation, 1f1b/zb-h1", {"micro_batch": mb, "activation_checkpointing": "none"},
                  layouts),
            Slice(f"mb={mb}, full recomputation, dp only", {"micro_batch": mb, "activation_checkpointing": "full",
                                                             "tp": 1, "pp": 1}, Space.runnable()))


def add_search_arguments(parser: argparse.ArgumentParser) -> None:
    """``--repeats`` and ``--models`` (the measured plans and the verdict: the module doc)."""
    parser.add_argument("--repeats", type=int, default=1, help="rounds per plan, median over them (default 1)")
    parser.add_argument("--models", default="", help="comma-separated model names (default: all of "
                        + ", ".join(c.name for c in CASES) + ")")


def train_flags(fields: dict[str, Any]) -> list[str]:
    """``config_from_plan``'s fields as ``shardwise train`` flags (tuples comma-joined, booleans lower-case)."""
    out: list[str] = []
    for key, value in fields.items():
        text = ",".join(value) if isinstance(value, tuple) else str(value).lower() if isinstance(value, bool) else value
        if isinstance(value, tuple) and not value:
            continue  # an empty split: train's default (balanced by parameters) is not what an empty flag would say
        out += [f"--parallel.{key}", str(text)]
    return out


def _gpt_config(case: Case) -> Any:
    from shardwise.runtime.config import load_config

    return load_config(preset="gpt-small", overrides={**case.model, "data.global_batch": case.global_batch})


def _refusal(case: Case, cfg: Any, plan: Layout) -> str | None:
    """Why ``shardwise train`` would not run ``plan`` (its own validation), or None."""
    if case.kind != "gpt":
        return None
    from shardwise.runtime.planning import apply_plan, config_from_plan

    try:
        apply_plan(cfg, config_from_plan(plan), DEVICES)
    except ValueError as exc:
        return str(exc).splitlines()[0]
    return None


def plan_set(case: Case, spec: ModelSpec, hw: Hardware, cfg: Any) -> dict[str, Any]:
    """The planner's order (runnable plans only) and the measured set, each plan with its slices."""
    gb, pins = case.global_batch, {"precision": "fp32"}
    full = search(spec, hw, devices=DEVICES, global_batch=gb, pins=pins, top=10**6)
    order: list[Prediction] = []
    refused: list[dict[str, Any]] = []
    for i, pred in enumerate(full):
        reason = _refusal(case, cfg, pred.plan)
        if reason is None:
            order.append(pred)
        else:
            refused.append({"describe": pred.plan.describe(), "rank": i + 1, "reason": reason})
    chosen: dict[Layout, list[str]] = {p.plan: ["top 3"] for p in order[:3]}
    labels = []
    for sl in slices(order[0].plan):
        labels.append(sl.label)
        found = search(spec, hw, devices=DEVICES, global_batch=gb, pins={**pins, **sl.pins}, space=sl.space, top=10**6)
        for pred in found:
            chosen.setdefault(pred.plan, []).append(sl.label)
    rank = {p.plan: i + 1 for i, p in enumerate(order)}
    by_plan = {p.plan: p for p in full}
    missing = [p.describe() for p in chosen if p not in by_plan]
    if missing:
        raise RuntimeError(f"plans of the slices missing from the planner's order: {missing}")
    rows = [_row(by_plan[plan], rank.get(plan), where) for plan, where in chosen.items()]
    rows = [r for r in rows if r["rank"] is not None]  # refused by train: listed with the refusals, not measured
    in_set = {p.describe() for p in chosen}
    plain = predict(spec, Layout(dp=DEVICES, micro_batch=1, precision="fp32").resolved(gb), hw, global_batch=gb)
    return {"full": full, "rows": rows, "refused": [r for r in refused if r["describe"] in in_set],
            "refused_total": len(refused),
            "space": "top 3 ∪ " + " ∪ ".join(labels), "plain_dp_bytes": plain.memory.total}


def _row(pred: Prediction, rank: int | None, where: list[str]) -> dict[str, Any]:
    return {"describe": pred.plan.describe(), "plan": pred.plan.to_json(), "rank": rank, "slices": where,
            "predicted_s": pred.step_time_s, "predicted_mem": pred.memory.total - pred.memory.buffers,
            "dominant": pred.dominant, "runs": [], "loads": [], "measured_mem": None, "measured_s": None, "status": ""}


RunLayout = Callable[[str, list[str], int, Path], dict[str, Any]]
"""``shardwise.bench.planner.run_layout``: one ``shardwise train`` run → median step, peak memory, the config it
ran."""


def _measure_gpt(case: Case, plan: Layout, steps: int, root: Path, name: str, run_layout: RunLayout) -> dict[str, Any]:
    from shardwise.runtime.config import config_from_dict
    from shardwise.runtime.planning import config_from_plan
    from shardwise.runtime.prediction import plan_from_config

    model = [w for k, v in case.model.items() for w in (f"--{k}", str(v))]
    # train's data parallelism picks its all-reduce from the calibration the planner priced it with
    flags = [*model, "--data.global_batch", str(case.global_batch), "--parallel.nproc", str(DEVICES),
             *train_flags(config_from_plan(plan)), "--parallel.calibration", CALIBRATION[0]]
    got = run_layout(name, flags, steps, root)
    ran = plan_from_config(config_from_dict(got["config"]), train_passes=True).resolved(case.global_batch)
    got["ran"] = ran.describe() if ran != plan.resolved(case.global_batch) else ""  # train ran something else: say so in the row
    return got


def _measure_mlp(case: Case, plan: Layout, steps: int, root: Path, name: str, run_layout: RunLayout) -> dict[str, Any]:
    out = root / name
    argv = [sys.executable, "-m", "shardwise.cli", "run", "-n", str(DEVICES), "-m", "benchmarks.planner.search_worker",
            "--model", json.dumps(case.model), "--plan", plan.dumps(), "--global-batch", str(case.global_batch),
            "--steps", str(steps), "--out", str(out), "--calibration", CALIBRATION[0]]
    root_dir = str(Path(__file__).resolve().parents[2])  # the ranks import ``benchmarks.*`` from the checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root_dir, os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    ranks = [json.loads(f.read_text()) for f in sorted(out.glob("rank*.json"))]
    if proc.returncode != 0 or len(ranks) != DEVICES:
        raise RuntimeError(f"{plan.describe()} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {"step_s": statistics.median(r["step_s"] for r in ranks), "ran": "",
            "memory": max(r["model_state_bytes"] + r["activation_peak_bytes"] for r in ranks)}


def _measure_all(case: Case, rows: list[dict[str, Any]], args: argparse.Namespace, root: Path,
                 run_layout: RunLayout) -> None:
    """Every row, ``args.repeats`` rounds, in one fixed shuffled order (module doc, step 3). A failed run is
    recorded in the row (``status``), never fatal."""
    measure = _measure_gpt if case.kind == "gpt" else _measure_mlp
    order = list(range(len(rows)))
    random.Random(f"{case.name}").shuffle(order)
    for round_ in range(args.repeats):
        for i in order:
            row, plan = rows[i], Layout.from_json(rows[i]["plan"])
            try:
                got = measure(case, plan, args.steps, root, f"{case.name}-{i}-r{round_}", run_layout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                row["status"] = "failed: " + str(exc).splitlines()[0][:200]
                print(f"  {row['describe']:48s} FAILED {row['status']}", flush=True)
                continue
            row["runs"].append(got["step_s"])
            row["loads"].append(round(os.getloadavg()[0], 2))  # 1-min load after the run: the others' jobs show here
            row["measured_mem"] = got["memory"]
            if got["ran"]:
                row["status"] = f"ran as {got['ran']}"
            print(f"  {row['describe']:48s} rank {row['rank']:3d}  predicted {row['predicted_s'] * 1e3:7.1f} ms  "
                  f"measured {got['step_s'] * 1e3:7.1f} ms  load {os.getloadavg()[0]:.1f}", flush=True)
    for row in rows:
        row["measured_s"] = statistics.median(row["runs"]) if row["runs"] else None


def run_case(case: Case, hw: Hardware, args: argparse.Namespace, root: Path, run_layout: RunLayout) -> dict[str, Any]:
    cfg = _gpt_config(case) if case.kind == "gpt" else None
    spec = ModelSpec.gpt(cfg.model) if cfg is not None else mlp_spec(MLPConfig(**case.model))
    if case.memory_bytes is not None:
        hw = dataclasses.replace(hw, memory_bytes=case.memory_bytes)
    chosen = plan_set(case, spec, hw, cfg)
    full = chosen["full"]
    print(f"{case.name}: {len(full)} plans fit, measuring {len(chosen['rows'])}; first choice "
          f"{chosen['rows'][0]['describe'] if chosen['rows'] else '-'}", flush=True)
    load = os.getloadavg()
    _measure_all(case, chosen["rows"], args, root, run_layout)
    return {"name": case.name, "kind": case.kind, "description": case.description, "params": spec.params,
            "global_batch": case.global_batch, "devices": DEVICES, "memory_bytes": hw.memory_bytes,
            "memory_source": "lowered for this model" if case.memory_bytes is not None else "the calibration's",
            "budget_bytes": full.budget_bytes, "plain_dp_bytes": chosen["plain_dp_bytes"],
            "plain_dp_fits": chosen["plain_dp_bytes"] <= full.budget_bytes, "candidates": full.candidates,
            "feasible": len(full), "space": chosen["space"], "rows": chosen["rows"], "not_runnable": chosen["refused"],
            "refused_total": chosen["refused_total"],
            "load_before": list(load), "load_after": list(os.getloadavg()), "verdict": verdict(chosen["rows"])}


CALIBRATION = [""]
"""The ``--hardware`` file the campaign plans with (``search_measured`` sets it): train runs get it as
``parallel.calibration``."""


def _hardware(text: str) -> Hardware:
    """The calibration measured at 4 ranks among ``--hardware`` files (the first one if none says so)."""
    paths = [f.strip() for f in text.split(",") if f.strip()]
    files = [Hardware.resolve(f) for f in paths]
    i = next((i for i, h in enumerate(files) if h.devices_per_node == DEVICES), 0)
    CALIBRATION[0] = str(Path(paths[i]).resolve())
    return files[i]


def search_measured(args: argparse.Namespace, *, run_layout: RunLayout) -> tuple[list[str], dict[str, Any]]:
    if not args.hardware:
        raise ValueError("--hardware FILE measured at 4 ranks is needed, e.g. --hardware "
                         "benchmarks/hardware_cpu_4ranks.json (`shardwise calibrate --nproc 4 --out FILE`)")
    if args.steps < 3 or args.repeats < 1:
        raise ValueError(f"--steps {args.steps} / --repeats {args.repeats}: need at least 3 steps (the first two are "
                         f"warm-up) and 1 round")
    wanted = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(wanted) - {c.name for c in CASES})
    if unknown:
        raise ValueError(f"--models {unknown}: unknown; choose from {[c.name for c in CASES]}")
    hw = _hardware(args.hardware)
    start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="sw-bench-search-") as tmp:
        models = [run_case(c, hw, args, Path(tmp), run_layout) for c in CASES if not wanted or c.name in wanted]
    import platform

    import torch

    meta = {"command": "python benchmarks/planner_search_measured.py " + " ".join(sys.argv[1:]), "hardware": args.hardware, "steps": args.steps, "repeats": args.repeats, "cores": os.cpu_count(),
            "machine": f"{platform.machine()} {platform.processor() or platform.system()}, torch {torch.__version__}",
            "load_at_start": list(start), "load_at_end": list(os.getloadavg())}
    return report_lines({**meta, "models": models}), {"search_measured": {**meta, "models": models}}


def report_lines(data: dict[str, Any]) -> list[str]:
    """The markdown of a campaign from its JSON (``data["search_measured"]``): re-renders a saved run too."""
    start, end = data["load_at_start"][0], data["load_at_end"][0]
    models = [{**m, "verdict": verdict(m["rows"])} for m in data["models"]]  # from the rows, whatever was saved
    lines = ["Planner search vs measurement, 4 CPU ranks "
             f"(calibration {data['hardware']}, {data['steps']} steps per plan, {data['repeats']} round(s), load average "
             f"at start {start:.1f}, at end {end:.1f} on {data['cores']} cores; {data.get('machine', '')}).", "",
             f"Command: `{data.get('command', '')}`", "", *summary_lines(models), ""]
    for m in models:
        lines += model_lines(m)
    return lines
