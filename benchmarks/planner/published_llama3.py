"""Llama 3 405B pre-training (Dubey et al. 2024, "The Llama 3 Herd of Models", arXiv 2407.21783, Table 4): two
context-parallel-free rows and the context-parallel row, on the ``h100-80g-sxm`` preset (pure, seconds).

What was checked against a public source: the paper's text (its arXiv HTML rendering, §3.3.2 and Table 4) gives
GPUs, TP, CP, PP, DP, sequence length, batch size per DP, tokens per batch, TF/s per GPU and BF16 MFU for the
three rows; GPUs, TP, CP, PP, tokens and TF/s also match Pavan Balaji's SC'24 slide (reproduced at
glennklockwood.com/garden/llama-3.1). The CP row's DP reads 4 in the paper, which contradicts its own GPUs and
tokens (8 · 16 · 16 · 4 = 8,192 GPUs, not 16,384; 4 · 16 · 131,072 = 8.4M tokens, not 16M): DP = GPUs / (TP · CP ·
PP) = 8 is used, which reproduces both. The model's 126 layers, width 16,384, 128 heads, 8 KV heads and FFN
53,248 are the paper's Table 3, the 128,256-token vocabulary the Llama 3 tokenizer's config.

The table's TF/s are model FLOPs (430 / 989 = 43 %, its MFU column): recomputation not counted, causal
attention counted as the half a fused kernel computes. ``model_tflops`` counts them that way from the spec
(3 × forward GEMMs with the attention cores halved) over the predicted step, so the comparison does not depend
on the planner's own FLOP convention (Megatron's, attention counted in full).

Not stated by the table, assumed alike for all three rows (nothing is fitted to them): the interleaved schedule
with two model chunks per pipeline rank (``megatron_plan``'s convention for Megatron-LM Table 1), micro-batch 1
(batch size / DP = micro-batches per flush), no activation recomputation (the paper trains 8K sequences without
it), sequence parallelism with TP, ZeRO-1 over dp × cp, bf16-mixed, and the ``shardwise`` runtime (data-
parallel reduction overlapped with backward, asynchronous pipeline transfers). Llama 3's CP all-gathers K/V
before the attention instead of passing blocks around a ring: the bytes per rank are the same (cp − 1 blocks).

Attention: the spec's ``flash`` core on a GPU preset, priced as an IO-aware fused kernel (FlashAttention, which
2024 training runs use; ``compute.io_aware_attention``): its FLOPs, causal half skipped, at the GEMM efficiency
of the per-head products, with ``O(s·h)`` memory traffic (Q, K, V, O, the log-sum-exp) instead of the ``s × s``
scores. The Megatron-LM 2021 and Korthikanti 2022 rows keep ``attention="unfused"`` (their kernels wrote the
scores to memory).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

from shardwise.planner.hardware import Hardware
from shardwise.planner.plan import Layout
from shardwise.planner.predict import Prediction, predict
from shardwise.planner.spec import ModelSpec

__all__ = ["Llama3Row", "LLAMA3_TABLE4", "LLAMA3_405B", "SOURCE_NOTE", "llama3_spec", "llama3_plan",
           "llama3_prediction", "model_tflops", "llama3_table"]


@dataclass(frozen=True)
class Llama3Row:
    gpus: int
    tp: int
    cp: int
    pp: int
    dp: int
    seq: int
    batch_per_dp: int
    tflops: float
    """Published TF/s per GPU (model FLOPs)."""
    mfu: float
    """Published BF16 MFU, %."""

    @property
    def global_batch(self) -> int:
        return self.dp * self.batch_per_dp


LLAMA3_TABLE4 = (
    Llama3Row(8192, 8, 1, 16, 64, 8192, 32, 430, 43),
    Llama3Row(16384, 8, 1, 16, 128, 8192, 16, 400, 41),
    Llama3Row(16384, 8, 16, 16, 8, 131072, 16, 380, 38),
)

LLAMA3_405B = dict(n_layer=126, hidden=16384, heads=128, kv_heads=8, ffn=53248, vocab_size=128256)
"""Llama 3 405B (the paper's Table 3): layers, model width, attention heads, key/value heads, FFN width, vocab."""

SOURCE_NOTE = ("every column checked against the paper's Table 4 (arXiv HTML rendering) and GPUs, TP, CP, PP, tokens "
               "and TF/s against Balaji's SC'24 slide; the CP row's DP reads 4 in the paper, inconsistent with its "
               "16,384 GPUs and 16M tokens: DP = GPUs / (TP·CP·PP) = 8 is used.")


def llama3_spec(seq: int) -> ModelSpec:
    return ModelSpec.llama(**LLAMA3_405B, seq_len=seq, name="llama3-405b")


def llama3_plan(row: Llama3Row) -> Layout:
    """The row's layout under the module doc's assumptions."""
    return Layout(dp=row.dp, cp=row.cp, tp=row.tp, pp=row.pp, micro_batch=1, schedule="interleaved", chunks=2,
                  activation_checkpointing="none", sequence_parallel=True, zero_stage=1, precision="bf16-mixed")


def llama3_prediction(row: Llama3Row, hw: Hardware | None = None) -> Prediction:
    hw = hw or Hardware.preset("h100-80g-sxm")
    return predict(llama3_spec(row.seq), llama3_plan(row), hw, global_batch=row.global_batch, runtime="shardwise")


def model_tflops(row: Llama3Row, pred: Prediction) -> float:
    """Model TF/s per GPU of the prediction, counted as the table counts them (module doc)."""
    spec = llama3_spec(row.seq)
    fwd = sum(layer.flops for layer in spec.layers)
    attn = sum(g.flops for layer in spec.layers for g in layer.gemms if not g.weight)
    return 3 * (fwd - attn / 2) * row.global_batch / pred.step_time_s / row.gpus / 1e12


def llama3_table() -> tuple[list[str], list[dict[str, Any]]]:
    """Predicted vs published TF/s per GPU for the three rows, as markdown lines and JSON rows."""
    peak = Hardware.preset("h100-80g-sxm").peak_flops["bf16"]
    lines = ["| GPUs | TP | CP | PP | DP | seq | batch/DP | published TF/s | predicted TF/s | error | published MFU | "
             "predicted MFU | bubble | cp comm | memory (GiB) | fits |", "|" + "---|" * 16]
    rows: list[dict[str, Any]] = []
    for r in LLAMA3_TABLE4:
        p = llama3_prediction(r)
        got = model_tflops(r, p)
        share = {k: v / p.step_time_s for k, v in p.breakdown.items()}
        row = {"gpus": r.gpus, "tp": r.tp, "cp": r.cp, "pp": r.pp, "dp": r.dp, "seq": r.seq,
               "batch_per_dp": r.batch_per_dp, "published_tflops": r.tflops, "predicted_tflops": got,
               "error": got / r.tflops - 1, "published_mfu": r.mfu, "predicted_mfu": 100 * got * 1e12 / peak,
               "bubble": share["pipeline_bubble"], "cp_comm": share.get("cp_comm", 0.0),
               "memory_gib": p.memory.total / 2**30, "fits": p.fits}
        rows.append(row)
        lines.append(f"| {r.gpus:,} | {r.tp} | {r.cp} | {r.pp} | {r.dp} | {r.seq:,} | {r.batch_per_dp} | "
                     f"{r.tflops:g} | "
                     f"{got:.0f} | {row['error']:+.1%} | {r.mfu}% | {row['predicted_mfu']:.1f}% | "
                     f"{row['bubble']:.1%} | {row['cp_comm']:.1%} | {row['memory_gib']:.1f} | "
                     f"{'yes' if p.fits else 'no'} |")
    errs = [abs(r["error"]) for r in rows]
    lines.insert(0, f"Llama 3 405B (Dubey et al. 2024, Table 4) on h100-80g-sxm: TF/s per GPU max |error| "
                    f"{max(errs):.1%}, median {statistics.median(errs):.1%} (CP = 16 row "
                    f"{rows[-1]['error']:+.1%}). Source: {SOURCE_NOTE}\n")
    lines.append("\nAssumed for every row (the table does not say): interleaved schedule with 2 chunks per pipeline "
                 "rank, micro-batch 1, no recomputation, sequence parallelism, ZeRO-1 over dp × cp, bf16-mixed, "
                 "overlapped data-parallel reduction (shardwise runtime). TF/s are model FLOPs with causal attention "
                 "halved, as the table's MFU column implies. Attention is a fused IO-aware kernel at the preset's "
                 "published rate (cuDNN on Hopper, FlashAttention-3 Figs. 5-6) with O(s·h) memory traffic, never the "
                 "s × s scores; the 2021–2022 tables above keep unfused attention (scores through memory).")
    from .published_memory import llama3_memory_lines  # imports this module: here, not at the top

    return lines + [""] + llama3_memory_lines(), rows


def chunk_lines(chunks: tuple[int, ...] = (2, 4, 8)) -> list[str]:
    """The rows' error with other numbers of model chunks per pipeline rank (the paper does not give its V; its 126
    layers over 16 stages with the embedding and the head alone in their chunks suggest 8): a sensitivity, not a
    fit — the check grades the module doc's 2."""
    hw = Hardware.preset("h100-80g-sxm")
    cells = []
    for v in chunks:
        errs = []
        for r in LLAMA3_TABLE4:
            p = predict(llama3_spec(r.seq), replace(llama3_plan(r), chunks=v), hw, global_batch=r.global_batch,
                        runtime="shardwise")
            errs.append(f"{model_tflops(r, p) / r.tflops - 1:+.1%}")
        cells.append(f"V = {v}: {' / '.join(errs)}")
    return ["Sensitivity to the chunks per pipeline rank (V, not published), TF/s error of the three rows: "
            + "; ".join(cells) + "."]
