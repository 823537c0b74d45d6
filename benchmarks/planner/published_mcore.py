"""Megatron-Core's H100 weak-scaling table (NVIDIA/Megatron-LM README, ``images/model_table.png``, Megatron-Core
r0.8.0): nine GPT models of 1.7B to 462B parameters on 48 to 6,144 H100s, run with tensor-parallel communication
overlapped with the GEMMs (``--tp-comm-overlap``), priced with and without ``Layout.async_tp`` on the
``h100-80g-sxm`` preset (pure, seconds).

Published (the table and the README text around it): attention heads, width, layers, TP, PP, DP (48 in every
row), GPUs, batch, TF/s per GPU and MFU; vocabulary 131,072 and sequence length 4,096 for every model;
data-parallel (``--overlap-grad-reduce --overlap-param-gather``), tensor-parallel (``--tp-comm-overlap``) and
pipeline communication overlapped with compute; throughput end to end. The TF/s are model FLOPs: 408.8 / 989
= 41 %, the MFU column (Megatron-LM's count, attention in full and no recomputation, the planner's ``mfu``).

Not stated, assumed alike for every row (nothing fitted to them): untied input and output embeddings (the
parameter counts say so: 1.75B and 7.11B for the two smallest rows, 1.48B and 6.58B tied), biases, no dropout,
a fused IO-aware attention kernel, bf16-mixed (2 + 2 + 12 bytes per parameter), sequence parallelism with every
TP > 1 (Transformer Engine's tp-comm overlap needs it), ZeRO-1 over dp (``--overlap-param-gather`` needs
Megatron's distributed optimizer), micro-batch 1, no recomputation, and the interleaved schedule with two model
chunks per pipeline rank (``published_llama3``'s convention); the ``shardwise`` runtime (data-parallel reduction
overlapped with backward).
"""

from __future__ import annotations

import statistics
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from shardwise.planner.hardware import Hardware
from shardwise.planner.plan import Layout
from shardwise.planner.predict import Prediction, predict
from shardwise.planner.spec import ModelSpec
from shardwise.planner.tp_overlap import in_place_pieces

from .published import MegatronRow

__all__ = ["McoreRow", "MCORE_WEAK_SCALING", "mcore_spec", "mcore_plan", "mcore_prediction", "mcore_table"]


@dataclass(frozen=True)
class McoreRow(MegatronRow):
    """One row of the table: Narayanan's row fields (``tflops`` here: the published model TF/s per GPU) and the
    published MFU."""

    mfu: int = 0
    """Published MFU, % of 989 TF/s."""


MCORE_WEAK_SCALING = (
    McoreRow(1.7, 16, 2048, 24, 1, 1, 48, 192, 408.8, 41), McoreRow(7.1, 32, 4096, 30, 2, 1, 96, 192, 465.9, 47),
    McoreRow(16, 48, 6144, 32, 4, 1, 192, 192, 489.1, 49), McoreRow(32, 56, 7168, 48, 8, 1, 384, 192, 459.6, 46),
    McoreRow(70, 64, 8192, 84, 8, 2, 768, 384, 419.7, 42), McoreRow(119, 80, 10240, 92, 8, 4, 1536, 768, 420.5, 43),
    McoreRow(177, 96, 12288, 96, 8, 6, 2304, 1152, 432.8, 44),
    McoreRow(314, 128, 16384, 96, 8, 8, 3072, 1536, 474.4, 48),
    McoreRow(462, 144, 18432, 112, 8, 16, 6144, 3072, 459.9, 47),
)
"""Megatron-Core r0.8.0 on H100 (NVIDIA/Megatron-LM README, model table): DP = 48 in every row."""

VOCAB, SEQ = 131072, 4096


def mcore_spec(row: McoreRow) -> ModelSpec:
    return ModelSpec.gpt(n_layer=row.layers, n_embd=row.hidden, n_head=row.heads, vocab_size=VOCAB, seq_len=SEQ,
                         block_size=SEQ, tie_weights=False, dropout=False, attention="flash",
                         name=f"mcore-gpt-{row.params_b:g}b")


def mcore_plan(row: McoreRow, *, async_tp: bool) -> Layout:
    """The row's layout under the module doc's assumptions; ``async_tp`` only where tp > 1."""
    return Layout(dp=row.gpus // (row.tp * row.pp), tp=row.tp, pp=row.pp, micro_batch=1,
                  schedule="interleaved" if row.pp > 1 else "1f1b", chunks=2 if row.pp > 1 else 1,
                  sequence_parallel=row.tp > 1, async_tp=async_tp and row.tp > 1, zero_stage=1,
                  precision="bf16-mixed")


def mcore_prediction(row: McoreRow, *, async_tp: bool, in_place: bool = False,
                     hw: Hardware | None = None) -> Prediction:
    """The row predicted without or with ``async_tp``; ``in_place``: its pieces assembled in place
    (``tp_overlap.IN_PLACE_PIECES``) instead of as the runtime assembles them today."""
    hw = hw or Hardware.preset("h100-80g-sxm")
    with in_place_pieces() if in_place else nullcontext():
        return predict(mcore_spec(row), mcore_plan(row, async_tp=async_tp), hw, global_batch=row.batch,
                       runtime="shardwise")


def mcore_table() -> tuple[list[str], list[dict[str, Any]]]:
    """Published vs predicted TF/s per GPU without ``async_tp``, with it as the runtime assembles the pieces
    today, and with the pieces assembled in place; markdown lines and JSON rows."""
    peak = Hardware.preset("h100-80g-sxm").peak_flops["bf16"]
    lines = ["| model | TP | PP | GPUs | batch | published TF/s | no overlap | error | async_tp | error | "
             "async_tp, in place | error | tp comm (none / async / in place) | memory (GiB) |", "|" + "---|" * 14]
    rows: list[dict[str, Any]] = []
    for r in MCORE_WEAK_SCALING:
        preds = [mcore_prediction(r, async_tp=False)]
        if r.tp > 1:
            preds += [mcore_prediction(r, async_tp=True), mcore_prediction(r, async_tp=True, in_place=True)]
        got = [p.mfu * peak / 1e12 for p in preds]
        err = [g / r.tflops - 1 for g in got]
        tp = [p.breakdown["tp_comm"] / p.step_time_s for p in preds]
        row = {"params_b": r.params_b, "tp": r.tp, "pp": r.pp, "gpus": r.gpus, "batch": r.batch,
               "published_tflops": r.tflops, "predicted_tflops": got[0], "error": err[0], "tp_comm": tp[0],
               "memory_gib": preds[0].memory.total / 2**30, "fits": preds[0].fits}
        if r.tp > 1:
            row.update(predicted_tflops_async_tp=got[1], error_async_tp=err[1], tp_comm_async_tp=tp[1],
                       predicted_tflops_in_place=got[2], error_in_place=err[2], tp_comm_in_place=tp[2])
        rows.append(row)
        cells = [f"{got[j]:.1f} | {err[j]:+.1%}" if j < len(got) else "— | —" for j in range(3)]
        lines.append(f"| {r.params_b:g}B | {r.tp} | {r.pp} | {r.gpus:,} | {r.batch:,} | {r.tflops:g} | "
                     f"{' | '.join(cells)} | {' / '.join(f'{x:.1%}' for x in tp)} | {row['memory_gib']:.1f} |")
    with_tp = [r for r in rows if r["tp"] > 1]
    med = lambda key: statistics.median(abs(r[key]) for r in with_tp)  # noqa: E731
    flat = next(r for r in with_tp if r["tp"] == 8 and r["pp"] == 1)
    lines.insert(0, f"Megatron-Core r0.8.0 weak scaling on H100 (NVIDIA/Megatron-LM README, run with "
                    f"--tp-comm-overlap) on h100-80g-sxm, the TP > 1 rows' median |error|: {med('error'):.1%} without "
                    f"the overlap, {med('error_async_tp'):.1%} with async_tp as the runtime assembles the pieces, "
                    f"{med('error_in_place'):.1%} with them assembled in place; TP 8 without a pipeline "
                    f"({flat['params_b']:g}B): {flat['error']:+.1%} / {flat['error_async_tp']:+.1%} / "
                    f"{flat['error_in_place']:+.1%}.\n")
    lines.append("\nAssumed for every row (the table does not say): untied embeddings (the parameter counts), no "
                 "dropout, fused attention, bf16-mixed, sequence parallelism with TP > 1, ZeRO-1, micro-batch 1, no "
                 "recomputation, interleaved schedule with 2 chunks per pipeline rank, shardwise runtime. TF/s are "
                 "model FLOPs (attention in full), as the MFU column implies. The TP 1 row has no tensor-parallel "
                 "communication to overlap. 'async_tp': the pieces as shardwise/parallel/tensor/overlap.py assembles "
                 "them (a reduce-scatter's received partial sums added by a kernel of their own, the gathered input "
                 "concatenated); 'in place': those passes left out (planner/tp_overlap.py, IN_PLACE_PIECES).")
    return lines, rows
