"""``shardwise bench pp``, the report: per-rank numbers gathered over the pipeline axis, the timelines analysed
(``bench_analysis``), tables printed and ``--json`` written by pipeline coordinate 0. See ``bench.py``."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
from typing import Any

import torch

from .pp_analysis import analyse

__all__ = ["gather_and_report"]

AXIS = "pp"
_FIELDS = ("ours_ms", "torch_ms", "vs_torch", "held", "saved_ours", "saved_torch", "loss_ours", "loss_torch")


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _paired(a: list[list[float]], b: list[list[float]]) -> float:
    """Median over rounds of (round median of a) / (round median of b)."""
    return _med([_med(x) / _med(y) for x, y in zip(a, b)]) if a and b else float("nan")


def _local_row(r: dict[str, Any]) -> list[float]:
    t = r["times"]
    flat = {side: [s for rnd in t[side] for s in rnd] for side in t}
    saved = r["saved"] + [float("nan")] * (2 - len(r["saved"]))
    loss = r["loss"] + [float("nan")] * (2 - len(r["loss"]))
    return [1e3 * _med(flat["ours"]), 1e3 * _med(flat["torch"]), _paired(t["ours"], t["torch"]), float(r["held"]),
            saved[0] / 2**20, saved[1] / 2**20, loss[0], loss[1]]


def gather_and_report(args: argparse.Namespace, names: list[str], pipes: dict, res: dict, mesh: Any,
                      sizes: tuple[int, int], load_start: tuple[float, float, float]) -> dict[str, Any] | None:
    """All-gather every rank's numbers (collective along the pipeline axis); coordinate 0 prints and writes
    ``--json``, returning the results dict (``None`` elsewhere). ``sizes``: (world size, model parameters)."""
    import shardwise as sw

    world_size, params = sizes
    zbs = [z for z in ("zb-h1", "zb-h2") if z in names and "1f1b" in names]  # compared with ours' 1f1b
    local = [v for n in names for v in _local_row(res[n])]
    local += [_paired(res[z]["times"]["ours"], res["1f1b"]["times"]["ours"]) for z in zbs]
    rows = sw.comm.all_gather(torch.tensor([local], dtype=torch.float64, device=mesh.device), mesh, AXIS).cpu()
    if mesh.coord(AXIS) != 0:
        return None
    k = len(_FIELDS)
    out: dict[str, Any] = {"ranks": world_size, "preset": args.preset, "n_layer": pipes[names[0]].model.config.n_layer,
                           "n_embd": pipes[names[0]].model.config.n_embd, "batch": args.batch, "seq": args.seq,
                           "microbatches": args.microbatches, "threads": args.threads, "steps": args.steps,
                           "repeats": args.repeats, "recv_ahead": pipes[names[0]].recv_ahead,
                           "recv_before_send": pipes[names[0]].recv_before_send, "transport": args.transport,
                           "transport_used": pipes[names[0]].used_transport, "device": mesh.device.type,
                           "host": platform.node(),
                           "torch": torch.__version__, "params": params,
                           "load_avg_start": load_start[0], "load_avg_end": os.getloadavg()[0], "schedules": {}}
    for j, name in enumerate(names):
        cols = rows[:, j * k:(j + 1) * k]
        per = {f: [float(v) for v in cols[:, i]] for i, f in enumerate(_FIELDS)}
        reports = [analyse(ev, pipes[name].schedule, pipes[name].lowered) for ev in res[name]["timelines"]]
        out["schedules"][name] = _schedule_row(name, per, reports, pipes[name].schedule)
    out["zb_vs_1f1b"] = {z: _zb_row(out["schedules"][z], out["schedules"]["1f1b"],
                                    float(rows[:, len(names) * k + i].mean())) for i, z in enumerate(zbs)}
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(_plain(out), f, indent=1)
    return out


def _plain(v: Any) -> Any:
    """JSON-safe: nan -> None (strict JSON has no NaN)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return None if isinstance(v, float) and math.isnan(v) else v


def _schedule_row(name: str, per: dict[str, list[float]], reports: list, schedule: Any) -> dict[str, Any]:
    last = schedule.rank_of(schedule.num_stages - 1)
    costs = [r.costs for r in reports]
    ms = lambda vals: [round(1e3 * v, 4) for v in vals]  # noqa: E731
    per_stage = {kind: ms([_med([getattr(c, kind)[s] for c in costs]) for s in range(schedule.num_stages)])
                 for kind in ("F", "B", "W")}
    return {
        "ours_ms": max(per["ours_ms"]), "torch_ms": max(per["torch_ms"]) if not any(map(math.isnan, per["torch_ms"])) else None,
        "vs_torch": statistics.mean(per["vs_torch"]) if not any(map(math.isnan, per["vs_torch"])) else None,
        "loss_ours": per["loss_ours"][last], "loss_torch": per["loss_torch"][last] if per["loss_torch"] else None,
        "peak_held": [int(v) for v in per["held"]],
        "saved_mib_ours": per["saved_ours"], "saved_mib_torch": per["saved_torch"],
        "bubble_measured": _med([r.measured for r in reports]), "bubble_predicted": _med([r.predicted for r in reports]),
        "bubble_rel_diff": _med([r.rel_diff for r in reports]),
        "bubble_rel_diff_rounds": [round(r.rel_diff, 4) for r in reports],
        "makespan_ms": 1e3 * _med([r.makespan for r in reports]),
        "predicted_makespan_ms": 1e3 * _med([r.predicted_makespan for r in reports]),
        "costs_ms": per_stage, "comm_ms": 1e3 * _med([float(c.comm) for c in costs]),
        "fitted_comm_ms": 1e3 * _med([r.fitted_comm for r in reports]),
        "overhead_ms": 1e3 * _med([float(c.overhead) for c in costs]),
        "post_ms": 1e3 * _med([float(c.post) for c in costs]),
    }


def _zb_row(zb: dict[str, Any], one: dict[str, Any], ratio: float) -> dict[str, Any]:
    return {"step_ratio": ratio, "measured_gain": 1 - ratio,
            "makespan_gain": 1 - zb["makespan_ms"] / one["makespan_ms"],
            "simulated_gain": 1 - zb["predicted_makespan_ms"] / one["predicted_makespan_ms"],
            "peak_held": [max(zb["peak_held"]), max(one["peak_held"])],
            "saved_mib": [max(zb["saved_mib_ours"]), max(one["saved_mib_ours"])]}


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _print(o: dict[str, Any]) -> None:
    print(f"\nshardwise bench pp: {o['ranks']} ranks ({o['device']}, {o['threads'] or 'auto'} thread(s) each), "
          f"{o['preset']} n_layer={o['n_layer']} n_embd={o['n_embd']} ({o['params'] / 1e6:.2f}M params, untied), "
          f"batch {o['batch']}x{o['seq']}, m={o['microbatches']}, {o['repeats']} rounds x {o['steps']} steps, "
          f"torch {o['torch']}, {o['host']}, load avg {o['load_avg_start']:.2f} -> {o['load_avg_end']:.2f}, "
          f"receives posted >= {o['recv_ahead']} action(s) ahead"
          + (" and before their send" if o["recv_before_send"] else "") + f", transport {o['transport']}"
          + (f" ({o['transport_used']})" if o["transport"] == "auto" else "") + " (torch: gloo)")
    print(f"{'schedule':<12}{'ours ms':>9}{'torch ms':>10}{'vs torch':>10}{'loss diff':>11}{'bubble':>8}{'sim':>8}"
          f"{'rel diff':>10}{'held/rank':>12}  saved MiB/rank ours | torch")
    for name, r in o["schedules"].items():
        diff = None if r["loss_torch"] is None or math.isnan(r["loss_torch"]) else abs(r["loss_ours"] - r["loss_torch"])
        held = ",".join(str(v) for v in r["peak_held"])
        saved = (",".join(_fmt(v, ".1f") for v in r["saved_mib_ours"]) + " | "
                 + ",".join(_fmt(v, ".1f") for v in r["saved_mib_torch"]))
        print(f"{name:<12}{r['ours_ms']:>9.1f}{_fmt(r['torch_ms'], '.1f'):>10}{_fmt(r['vs_torch'], '.3f'):>10}"
              f"{_fmt(diff, '.1e'):>11}{r['bubble_measured']:>8.3f}{r['bubble_predicted']:>8.3f}"
              f"{r['bubble_rel_diff']:>+10.1%}{held:>12}  {saved}")
    print("measured costs (ms, median per stage over rounds; comm: median wait of a receiving rank; fitted: the comm "
          "that makes the simulated makespan the measured one):")
    for name, r in o["schedules"].items():
        c = r["costs_ms"]
        parts = [f"{k} " + "/".join(f"{v:.2f}" for v in c[k]) for k in ("F", "B", "W") if any(c[k])]
        print(f"  {name:<12}" + "  ".join(parts) + f"  comm {r['comm_ms']:.2f} (fitted {r['fitted_comm_ms']:.2f})"
              f"  host {r['overhead_ms']:.2f}/action + {r['post_ms']:.2f}/message"
              f"  compute makespan {r['makespan_ms']:.1f} (sim {r['predicted_makespan_ms']:.1f})")
    for name, z in o["zb_vs_1f1b"].items():
        print(f"{name} vs 1f1b (ours): step ratio {z['step_ratio']:.3f} (gain {z['measured_gain']:+.1%}), compute "
              f"makespan gain {z['makespan_gain']:+.1%}, simulated gain {z['simulated_gain']:+.1%}; peak held "
              f"{z['peak_held'][0]} vs {z['peak_held'][1]}, saved MiB {z['saved_mib'][0]:.1f} vs {z['saved_mib'][1]:.1f}")
