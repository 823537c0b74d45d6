"""The verdict and tables of ``benchmarks/planner_search_measured.py`` (pure: numbers in, numbers and text out).

A *row* is one measured plan: ``describe`` (``Layout.describe()``), ``rank`` (its place in the planner's order
over the whole runnable space, among the plans ``shardwise train`` accepts; 1 = the first choice),
``predicted_s``, ``measured_s`` (None when the run failed), ``predicted_mem``, ``measured_mem`` and
``slices`` (which part of the measured set it came from). The two criteria of the issue:

* the planner's first choice is within ``TOLERANCE`` (5 %) of the best measured plan:
  ``(measured(first) - measured(best)) / measured(best) <= 0.05``;
* the best measured plan is in the planner's top ``TOP`` (3): ``rank(best) <= 3``.
"""

from __future__ import annotations

from typing import Any, Sequence

from shardwise.bench.planner_measured import kendall_tau

__all__ = ["TOLERANCE", "TOP", "verdict", "tau", "model_lines", "summary_lines"]

TOLERANCE = 0.05
TOP = 3


def tau(a: Sequence[float], b: Sequence[float]) -> float:
    """Kendall's τ-a of two orders (1: the same): ``planner_measured.kendall_tau``."""
    return kendall_tau(list(a), list(b))


def verdict(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """First choice, best measured plan, their gap and both criteria for one model's rows (see module doc).
    A first choice that was not measured (its run failed) fails the first criterion: nothing shows it is good."""
    measured = [r for r in rows if r.get("measured_s") is not None]
    if not measured:
        raise ValueError("no plan was measured: nothing to compare the planner's choice with")
    best = min(measured, key=lambda r: r["measured_s"])
    first = next((r for r in rows if r["rank"] == 1), None)
    out: dict[str, Any] = {"best": best["describe"], "best_s": best["measured_s"], "best_rank": best["rank"],
                           "best_in_top": best["rank"] <= TOP, "measured": len(measured),
                           "tau": tau([r["predicted_s"] for r in measured], [r["measured_s"] for r in measured])}
    if first is None or first.get("measured_s") is None:
        return {**out, "first": first["describe"] if first else None, "first_s": None, "gap": None,
                "within": False}
    gap = (first["measured_s"] - best["measured_s"]) / best["measured_s"]
    # 1e-12: a gap of exactly 5 % passes whatever the float rounding of the division
    return {**out, "first": first["describe"], "first_s": first["measured_s"], "gap": gap,
            "within": gap <= TOLERANCE + 1e-12}


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1e3:.0f}"


def _mb(value: float | None) -> str:
    return "—" if not value else f"{value / 1e6:.1f}"


def model_lines(model: dict[str, Any]) -> list[str]:
    """One model's section: the budget, the verdict and every measured plan (planner's order), then the plans
    ``shardwise train`` refused."""
    v = model["verdict"]
    gap = "—" if v["gap"] is None else f"{v['gap']:+.1%}"
    lines = [f"### {model['name']} ({model['description']})", "",
             f"Memory: {model['memory_bytes'] / 1e6:.0f} MB per rank ({model['memory_source']}), budget "
             f"{model['budget_bytes'] / 1e6:.1f} MB after the 10 % margin; plain data parallelism (dp "
             f"{model['devices']}, ZeRO 0, no recomputation) needs at least {model['plain_dp_bytes'] / 1e6:.1f} MB: "
             f"{'fits' if model['plain_dp_fits'] else '**does not fit**'}. {model['feasible']} of "
             f"{model['candidates']} layouts fit; {len(model['rows'])} measured ({model['space']}).", "",
             f"First choice **{v['first']}**: measured {_ms(v['first_s'])} ms; best measured **{v['best']}** "
             f"{_ms(v['best_s'])} ms, planner rank {v['best_rank']}. Gap {gap}: within 5 %: "
             f"**{'yes' if v['within'] else 'NO'}**; best in the top 3: **{'yes' if v['best_in_top'] else 'NO'}**. "
             f"Kendall τ of predicted vs measured step times over the measured plans: {v['tau']:.2f}.",
             "", "| rank | layout | predicted ms | measured ms | error | measured rank | predicted MB | measured MB "
             "| from |", "|---|---|---|---|---|---|---|---|---|"]
    order = sorted((r for r in model["rows"] if r.get("measured_s") is not None), key=lambda r: r["measured_s"])
    place = {id(r): i + 1 for i, r in enumerate(order)}
    for r in sorted(model["rows"], key=lambda r: r["rank"]):
        err = f"{r['predicted_s'] / r['measured_s'] - 1:+.0%}" if r.get("measured_s") else r.get("status", "failed")
        lines.append(f"| {r['rank']} | {r['describe']} | {_ms(r['predicted_s'])} | {_ms(r.get('measured_s'))} | {err} "
                     f"| {place.get(id(r), '—')} | {_mb(r['predicted_mem'])} | {_mb(r.get('measured_mem'))} | "
                     f"{', '.join(r['slices'])} |")
    if model.get("not_runnable"):
        lines += ["", "Not runnable by `shardwise train` (refused by its validation, skipped):", ""]
        lines += [f"- {n['describe']} (planner rank {n['rank']}): {n['reason']}" for n in model["not_runnable"]]
    return lines + [""]


def summary_lines(models: Sequence[dict[str, Any]]) -> list[str]:
    """The table of verdicts, one row per model."""
    lines = ["| model | budget MB | plain dp fits | measured | first choice | its ms | best measured | ms | "
             "best's rank | gap | within 5 % | best in top 3 | τ |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in models:
        v = m["verdict"]
        gap = "—" if v["gap"] is None else f"{v['gap']:+.1%}"
        lines.append(f"| {m['name']} | {m['budget_bytes'] / 1e6:.1f} | {'yes' if m['plain_dp_fits'] else 'no'} | "
                     f"{v['measured']} | {v['first']} | {_ms(v['first_s'])} | {v['best']} | {_ms(v['best_s'])} | "
                     f"{v['best_rank']} | {gap} | {'yes' if v['within'] else 'NO'} | "
                     f"{'yes' if v['best_in_top'] else 'NO'} | {v['tau']:.2f} |")
    return lines
