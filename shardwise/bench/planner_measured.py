"""The measured side of ``shardwise bench planner``: the layouts it trains, the table it prints, and how far its
measurement agrees with itself. Pure."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["MODEL", "LAYOUTS", "kendall_tau", "measurement_agreement", "layout_config", "predict_layout",
           "measured_table"]

MODEL = ["--preset", "gpt-small", "--model.n_layer", "6", "--data.global_batch", "16", "--parallel.micro_batch", "4"]
"""The measured model: gpt-small widened to 6 blocks (so 4 pipeline ranks × 2 chunks have units to cut)."""

LAYOUTS: list[tuple[str, list[str]]] = [
    ("dp2", ["--parallel.nproc", "2"]),
    ("tp2", ["--parallel.nproc", "2", "--parallel.tp", "2"]),
    ("pp2 1f1b", ["--parallel.nproc", "2", "--parallel.pp", "2"]),
    ("dp2 zero1", ["--parallel.nproc", "2", "--parallel.zero_stage", "1"]),
    ("dp2 zero3", ["--parallel.nproc", "2", "--parallel.zero_stage", "3"]),
    ("dp2 ckpt", ["--parallel.nproc", "2", "--parallel.activation_checkpointing", "true"]),
    ("dp4", ["--parallel.nproc", "4"]),
    ("dp4 zero2", ["--parallel.nproc", "4", "--parallel.zero_stage", "2"]),
    ("dp2 tp2", ["--parallel.nproc", "4", "--parallel.tp", "2"]),
    ("tp4", ["--parallel.nproc", "4", "--parallel.tp", "4"]),
    ("pp2 dp2 1f1b", ["--parallel.nproc", "4", "--parallel.pp", "2"]),
    ("pp4 gpipe", ["--parallel.nproc", "4", "--parallel.pp", "4", "--parallel.pp_schedule", "gpipe"]),
    ("pp4 1f1b", ["--parallel.nproc", "4", "--parallel.pp", "4"]),
    ("pp4 zb-h1", ["--parallel.nproc", "4", "--parallel.pp", "4", "--parallel.pp_schedule", "zb-h1"]),
    ("pp2 interleaved", ["--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.pp_schedule", "interleaved",
                         "--parallel.pp_chunks", "2"]),
]


def kendall_tau(a: list[float], b: list[float]) -> float:
    """Kendall's τ-a of two equally long sequences (1: same order, -1: reversed). Pure."""
    n = len(a)
    pairs = concordant = discordant = 0
    for i in range(n):
        for j in range(i + 1, n):
            pairs += 1
            s = (a[i] - a[j]) * (b[i] - b[j])
            concordant += s > 0
            discordant += s < 0
    return (concordant - discordant) / pairs if pairs else 1.0


def measurement_agreement(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """How far a campaign's measurement agrees with itself, and where the model's ranking errors lie. Pure.

    ``self_tau``: the median over rounds of τ(that round, the median of the other rounds) — the ceiling a
    model can be expected to reach against this measurement. ``resolved``: the pairs of layouts that every
    round orders the same way (the rest swap places between rounds); ``resolved_tau``: the model's τ over
    those pairs only. None with fewer than three rounds per layout (nothing to compare)."""
    rounds = [r.get("rounds_s", []) for r in rows]
    n = min((len(x) for x in rounds), default=0)
    if n < 3 or len(rows) < 2:
        return None
    selfs = [kendall_tau([x[k] for x in rounds], [statistics.median(x[:k] + x[k + 1:n]) for x in rounds])
             for k in range(n)]
    conc = disc = resolved = pairs = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            pairs += 1
            dm = rows[i]["measured_s"] - rows[j]["measured_s"]
            if not all((a - b) * dm > 0 for a, b in zip(rounds[i][:n], rounds[j][:n])):
                continue
            resolved += 1
            s = dm * (rows[i]["predicted_s"] - rows[j]["predicted_s"])
            conc += s > 0
            disc += s < 0
    return {"self_tau": statistics.median(selfs), "pairs": pairs, "resolved": resolved,
            "resolved_tau": (conc - disc) / resolved if resolved else float("nan")}


def predict_layout(cfg: Any, hw: Any) -> tuple[float, float, str]:
    """``(step seconds, memory bytes, dominant term)`` of one measured layout's config on ``hw``."""
    from ..planner import predict
    from ..runtime.prediction import gpt_spec, plan_from_config

    pred = predict(gpt_spec(cfg), plan_from_config(cfg, train_passes=True), hw, global_batch=cfg.data.global_batch)
    # like with like: the measured side counts model states and saved tensors, no buffers (the campaign
    # is fp32; under bf16 autocast's weight casts would be saved tensors there and buffers here)
    return pred.step_time_s, pred.memory.total - pred.memory.buffers, pred.dominant


def layout_config(name: str) -> Any:
    """The validated train config of ``LAYOUTS``' layout ``name`` (as its run saves it). ``KeyError`` if unknown."""
    from ..runtime.config import load_config, parse_overrides, validate

    flags = dict(LAYOUTS)[name]
    return validate(load_config(preset=MODEL[1], overrides=parse_overrides(MODEL[2:] + flags)), launch=True)


def measured_table(rows: list[dict[str, Any]]) -> list[str]:
    t_err = [r["predicted_s"] / r["measured_s"] - 1 for r in rows]
    m_err = [r["predicted_mem"] / r["measured_mem"] - 1 for r in rows if r["measured_mem"]]
    tau = kendall_tau([r["measured_s"] for r in rows], [r["predicted_s"] for r in rows])
    lines = ["| layout | measured step (ms) | predicted (ms) | error | measured memory (MiB) | predicted (MiB) | error | dominant |",
             "|---|---|---|---|---|---|---|---|"]
    for r, e in zip(rows, t_err):
        me = r["predicted_mem"] / r["measured_mem"] - 1 if r["measured_mem"] else float("nan")
        lines.append(f"| {r['layout']} | {r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {e:+.1%} | "
                     f"{r['measured_mem'] / 2**20:.1f} | {r['predicted_mem'] / 2**20:.1f} | {me:+.1%} | {r['dominant']} |")
    abs_t = [abs(e) for e in t_err]
    abs_m = [abs(e) for e in m_err] or [float("nan")]
    spread = [max(r["rounds_s"]) / min(r["rounds_s"]) - 1 for r in rows if len(r.get("rounds_s", [])) > 1]
    noise = (f"; rounds per layout {len(rows[0]['rounds_s'])}, median spread between a layout's fastest and "
             f"slowest round {statistics.median(spread):.1%}") if spread else ""
    agree = measurement_agreement(rows)
    if agree:
        noise += (f"; the measurement against itself (one round against the median of the others) τ "
                  f"{agree['self_tau']:.2f}; {agree['resolved']} of {agree['pairs']} pairs ordered alike by every "
                  f"round, the model's τ over them {agree['resolved_tau']:.2f}")
    lines.insert(0, f"Step time: median |error| {statistics.median(abs_t):.1%}, worst {max(abs_t):.1%}; memory: median "
                    f"|error| {statistics.median(abs_m):.1%}, worst {max(abs_m):.1%}; Kendall τ of the step-time "
                    f"ranking {tau:.2f} ({len(rows)} layouts){noise}.\n")
    return lines
