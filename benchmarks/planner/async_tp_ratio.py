"""The planner's prediction of ``shardwise bench tp``'s "vs sync" column: a step of the overlapped (``async_tp``)
variant over its unoverlapped twin, on the bench's shapes and a calibration file (pure, milliseconds).

The bench trains a stack of reference-GPT blocks (no embedding, no head) in fp32 on a (batch, seq, embd) input
with SGD; the prediction prices those blocks' forward, input-gradient and weight-gradient passes with and without
``Layout.async_tp`` (the SGD step and the loss, the same in both, are left out: the ratio is of the blocks). The
collectives are the calibration's ``native`` ones (the bench's gloo variants; its shared-memory variants have no
calibrated model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardwise.planner.builders import gpt_layers
from shardwise.planner.compute import layer_time
from shardwise.planner.hardware import Hardware
from shardwise.planner.plan import Layout
from shardwise.planner.predict import _hardware_for

__all__ = ["StepRatio", "bench_tp_ratio", "ratio_lines"]


@dataclass(frozen=True)
class StepRatio:
    tp: int
    sequence_parallel: bool
    sync_s: float
    """Predicted seconds of the blocks' forward + backward without the overlap."""
    async_s: float
    """... with ``async_tp``."""
    parts: dict[str, float]
    """``async_tp``'s tensor-parallel cost per step by part (exposed, contention, decomposition, accumulation)
    and the unoverlapped term, seconds."""

    @property
    def ratio(self) -> float:
        return self.async_s / self.sync_s


def bench_tp_ratio(hardware: Hardware | str, *, tp: int, sequence_parallel: bool = True, layers: int = 2,
                   embd: int = 256, heads: int = 8, batch: int = 4, seq: int = 128) -> StepRatio:
    """Predicted ``async / sync`` step of ``shardwise bench tp``'s defaults (``--layers 2 --embd 256 --heads 8
    --batch 4 --seq 128``) at ``tp`` ranks on ``hardware`` (a preset name or a calibration file)."""
    from shardwise.planner.compute import async_tp_times

    hw = Hardware.resolve(hardware) if isinstance(hardware, str) else hardware
    hw = _hardware_for(hw, tp, None)  # the probe's block factors, the host's cores shared by tp ranks
    blocks = [layer for layer in gpt_layers(n_layer=layers, h=embd, a=heads, v=256, s=seq, positions=seq, tie=True,
                                            bias=True, dropout=False, attention="flash") if layer.kind == "block"]
    per_node = min(tp, hw.devices_per_node)
    totals = []
    for overlap in (False, True):
        plan = Layout(tp=tp, micro_batch=batch, sequence_parallel=sequence_parallel, async_tp=overlap)
        times = [layer_time(b, plan, hw, flash=True, tp_per_node=per_node) for b in blocks]
        totals.append(sum(t.F + t.B + t.W for t in times))
        if overlap:
            sync = [layer_time(b, Layout(tp=tp, micro_batch=batch, sequence_parallel=sequence_parallel), hw,
                               flash=True, tp_per_node=per_node) for b in blocks]
            parts = {"unoverlapped": sum(t.tp_fwd + t.tp_bwd for t in sync)}
            for b in blocks:
                for part in async_tp_times(b, plan, hw, per_node):
                    for key in ("exposed", "contention", "decomposition", "accumulation"):
                        parts[key] = parts.get(key, 0.0) + getattr(part, key)
    return StepRatio(tp=tp, sequence_parallel=sequence_parallel, sync_s=totals[0], async_s=totals[1], parts=parts)


def ratio_lines(rows: list[tuple[str, StepRatio]]) -> tuple[list[str], list[dict[str, Any]]]:
    """A markdown table of predicted ratios (``(hardware label, ratio)`` rows) and their JSON rows."""
    lines = ["| hardware | tp | SP | sync ms | async_tp ms | predicted async / sync | tp comm unoverlapped ms | "
             "exposed | contention | decomposition | accumulation |", "|" + "---|" * 11]
    data = []
    for label, r in rows:
        p = {k: v * 1e3 for k, v in r.parts.items()}
        lines.append(f"| {label} | {r.tp} | {'yes' if r.sequence_parallel else 'no'} | {r.sync_s * 1e3:.2f} | "
                     f"{r.async_s * 1e3:.2f} | {r.ratio:.3f} | {p['unoverlapped']:.2f} | {p['exposed']:.2f} | "
                     f"{p['contention']:.2f} | {p['decomposition']:.2f} | {p['accumulation']:.2f} |")
        data.append({"hardware": label, "tp": r.tp, "sequence_parallel": r.sequence_parallel, "sync_s": r.sync_s,
                     "async_s": r.async_s, "ratio": r.ratio, "parts_s": dict(r.parts)})
    return lines, data


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner.async_tp_ratio",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--hardware",
                        default="benchmarks/hardware_cpu_2ranks.json:2,benchmarks/hardware_cpu_4ranks.json:4",
                        help="FILE:TP pairs, comma-separated (default: the committed 2- and 4-rank CPU calibrations)")
    parser.add_argument("--no-sp", action="store_true", help="without sequence parallelism")
    for flag, default in (("layers", 2), ("embd", 256), ("heads", 8), ("batch", 4), ("seq", 128)):
        parser.add_argument(f"--{flag}", type=int, default=default, help=f"as shardwise bench tp's (default {default})")
    parser.add_argument("--json", action="store_true", help="print the JSON rows instead of the table")
    args = parser.parse_args()
    rows = []
    for pair in args.hardware.split(","):
        path, _, tp = pair.rpartition(":")
        rows.append((path, bench_tp_ratio(path, tp=int(tp), sequence_parallel=not args.no_sp, layers=args.layers,
                                          embd=args.embd, heads=args.heads, batch=args.batch, seq=args.seq)))
    lines, data = ratio_lines(rows)
    print(json.dumps(data, indent=1) if args.json else "\n".join(lines))
