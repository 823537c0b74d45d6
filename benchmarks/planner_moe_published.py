"""The planner against published mixture-of-experts training throughput (pure: nothing runs but the planner).

    python benchmarks/planner_moe_published.py [--search] [--markdown FILE] [--json FILE]
    python benchmarks/planner_moe_published.py --a2a-check

The figure compared is **tokens/s per GPU** of pre-training (global batch × sequence / step time / GPUs), at the
published layout, on the ``h100-80g-sxm`` preset (DeepSeek-V3: an H800 made from it, see ``_h800``), bf16
weights with fp32 master copies in a distributed optimizer (``bf16-mixed``, ZeRO-1: Megatron-Core's setting),
flash attention, no recomputation, ``moe_imbalance`` 1.0 (the Megatron-Bridge runs force-balance the tokens
over the experts), runtime ``shardwise`` (gradient reduction overlapped with the last backward, as Megatron-Core's
``overlap_grad_reduce``). The rows and their sources:

* Megatron-Bridge's performance summary (NVIDIA-NeMo/Megatron-Bridge, ``docs/performance-summary-archive.md``:
  the 25.11 and 26.02 NeMo containers, "DGX-H100" tables; "we force-balance the token distribution among experts
  and all benchmarks are token-dropless"): GPT-OSS 120B in BF16 — the comparable rows — and Qwen3-30B-A3B and
  Qwen3-235B-A22B in FP8 (current scaling), which the planner prices at the bf16 peak (it has no FP8 GEMMs), so
  their predictions are expected low; they are listed apart.
* DeepSeek-V3 technical report (arXiv 2412.19437, §3 and Table 1): 2,048 H800 GPUs, PP 16, EP 64 over 8 nodes,
  ZeRO-1 data parallelism, no tensor parallelism, 4,096-token sequences, batch 15,360 after the ramp-up, FP8
  GEMMs, DualPipe overlapping the all-to-alls; pre-training 14.8 T tokens in 2.664 M GPU hours, i.e.
  14.8e12 / (2.664e6 × 3600) = 1,543 tokens/s/GPU on average over the run (a derived figure). Not comparable
  either (FP8, overlapped all-to-alls, a 1F1B stand-in for DualPipe).

Published fields the planner cannot represent are named in the row's note (Qwen3-235B's EP 32 over TP 2 × DP 16:
Megatron-Core folds expert parallelism over tensor- and data-parallel ranks, the planner's ``ep`` divides dp × cp;
it is priced at ep 16). ``--search``: also the planner's own best layout for the same GPUs and batch (the BF16
rows only: seconds each).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: the repository root makes ``shardwise`` importable from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shardwise.planner import Hardware, Layout, ModelSpec, predict, search  # noqa: E402

__all__ = ["ROWS", "MODELS", "rows", "main"]

_ARCHIVE = "Megatron-Bridge docs/performance-summary-archive.md"
_RECOMPUTE = ("the H100 recipe also recomputes the norms and the experts' activation (recompute_modules layernorm, "
              "moe_act), which the planner does not price")

MODELS: dict[str, dict[str, Any]] = {
    # openai/gpt-oss-120b config.json (transformers' GptOssConfig defaults are this model)
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=36, num_attention_heads=64,
                         num_key_value_heads=8, head_dim=64, vocab_size=201088, intermediate_size=2880,
                         num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                         layer_types=["sliding_attention", "full_attention"] * 18, attention_bias=True),
    # Qwen/Qwen3-30B-A3B config.json
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    # Qwen/Qwen3-235B-A22B config.json
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, vocab_size=151936, intermediate_size=12288,
                            moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8),
    # deepseek-ai/DeepSeek-V3 config.json (without the multi-token-prediction layer)
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
                        vocab_size=129280, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=256,
                        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}

ROWS: list[dict[str, Any]] = [
    dict(model="gpt-oss-120b", source=f"{_ARCHIVE}, 25.11, DGX-H100", precision="BF16", gpus=64, gbs=512, mbs=4,
         seq=4096, tp=1, pp=4, vp=1, ep=8, published=5630, comparable=True, note=_RECOMPUTE),
    dict(model="gpt-oss-120b", source=f"{_ARCHIVE}, 26.02, DGX-H100", precision="BF16", gpus=64, gbs=1280, mbs=1,
         seq=4096, tp=1, pp=4, vp=1, ep=8, published=5993, comparable=True, note=_RECOMPUTE),
    dict(model="qwen3-30b-a3b", source=f"{_ARCHIVE}, 25.11, DGX-H100", precision="FP8-CS", gpus=16, gbs=512, mbs=2,
         seq=4096, tp=1, pp=2, vp=24, ep=8, published=5275, comparable=False),
    dict(model="qwen3-30b-a3b", source=f"{_ARCHIVE}, 26.02, DGX-H100", precision="FP8", gpus=16, gbs=1024, mbs=1,
         seq=4096, tp=1, pp=2, vp=12, ep=8, published=5113, comparable=False),
    dict(model="qwen3-235b-a22b", source=f"{_ARCHIVE}, 25.11, DGX-H100", precision="FP8-CS", gpus=256, gbs=2048,
         mbs=1, seq=4096, tp=2, pp=8, vp=4, ep=32, published=1575, comparable=False,
         note="EP 32 > dp 16: priced at ep 16"),
    dict(model="qwen3-235b-a22b", source=f"{_ARCHIVE}, 26.02, DGX-H100", precision="FP8", gpus=256, gbs=8192,
         mbs=1, seq=4096, tp=2, pp=8, vp=4, ep=32, published=1633, comparable=False,
         note="EP 32 > dp 16: priced at ep 16"),
    dict(model="deepseek-v3", source="DeepSeek-V3 report (arXiv 2412.19437): 14.8T tokens / 2.664M H800 GPU-hours",
         precision="FP8", gpus=2048, gbs=15360, mbs=1, seq=4096, tp=1, pp=16, vp=1, ep=64, published=1543,
         comparable=False, hardware="h800", note="MBS not published (1 assumed); DualPipe priced as 1F1B"),
]


def _h800() -> Hardware:
    """An H800 SXM: the H100 SXM's compute and memory with NVLink cut to 400 of 900 GB/s (the export variant); the
    DeepSeek-V3 cluster's 400 Gb/s InfiniBand NIC per GPU is the preset's inter-node share already."""
    h100 = Hardware.preset("h100-80g-sxm")
    intra = dataclasses.replace(h100.intra, bus_bandwidth_Bps=h100.intra.bus_bandwidth_Bps * 400 / 900)
    return dataclasses.replace(h100, name="h800-80g-sxm (h100 preset, NVLink 400 GB/s)", intra=intra)


def _layout(row: dict[str, Any]) -> Layout:
    dp = row["gpus"] // (row["tp"] * row["pp"])
    ep = min(row["ep"], dp)  # see the row's note where the published EP exceeds dp × cp
    interleaved = row["vp"] > 1
    return Layout(dp=dp, tp=row["tp"], pp=row["pp"], ep=ep, zero_stage=1, micro_batch=row["mbs"],
                  schedule="interleaved" if interleaved else "1f1b", chunks=row["vp"] if interleaved else 1,
                  sequence_parallel=row["tp"] > 1, precision="bf16-mixed")


def rows(with_search: bool = False) -> list[dict[str, Any]]:
    """Every row with its prediction (and, ``with_search``, the planner's own best layout on the BF16 rows)."""
    out = []
    for row in ROWS:
        spec = ModelSpec.from_hf(MODELS[row["model"]], seq_len=row["seq"], name=row["model"])
        hw = _h800() if row.get("hardware") == "h800" else Hardware.preset("h100-80g-sxm")
        plan = _layout(row)
        pred = predict(spec, plan, hw, global_batch=row["gbs"])
        result = {**row, "layout": plan.describe(), "params": pred.params_text(),
                  "predicted": pred.tokens_per_s / row["gpus"], "fits": pred.fits,
                  "memory_gib": pred.memory.total / 2**30, "breakdown": dict(pred.breakdown)}
        result["ratio"] = result["predicted"] / row["published"]
        if with_search and row["comparable"]:
            start = time.perf_counter()
            best = search(spec, hw, devices=row["gpus"], global_batch=row["gbs"],
                          pins={"precision": "bf16-mixed"}).best
            result.update(search_layout=best.plan.describe(), search_predicted=best.tokens_per_s / row["gpus"],
                          search_s=time.perf_counter() - start)
        out.append(result)
    return out


def _table(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| model (total, active) | GPUs | precision | published layout | planner layout | published tok/s/GPU "
             "| predicted | predicted / published | fits (GiB) | source; note |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        published = f"gbs {r['gbs']} mbs {r['mbs']} seq {r['seq']} TP{r['tp']} PP{r['pp']} VP{r['vp']} EP{r['ep']}"
        lines.append(f"| {r['model']} ({r['params']}) | {r['gpus']} | {r['precision']} | {published} | "
                     f"{r['layout']} | {r['published']:,} | {r['predicted']:,.0f} | {r['ratio']:.2f} | "
                     f"{'yes' if r['fits'] else 'NO'} ({r['memory_gib']:.1f}) | {r['source']}"
                     f"{'; ' + r['note'] if r.get('note') else ''} |")
    return lines


def _search_lines(results: list[dict[str, Any]]) -> list[str]:
    found = [r for r in results if "search_layout" in r]
    if not found:
        return []
    lines = ["", "| model | published layout, predicted tok/s/GPU | planner's best layout | its predicted tok/s/GPU | "
             "search s |", "|---|---|---|---|---|"]
    for r in found:
        lines.append(f"| {r['model']} gbs {r['gbs']} | {r['layout']}: {r['predicted']:,.0f} | {r['search_layout']} | "
                     f"{r['search_predicted']:,.0f} | {r['search_s']:.1f} |")
    return lines


def a2a_check(calibration: str = "benchmarks/hardware_cpu_4ranks.json",
              runs: str = "benchmarks/log/alltoall_2026-11-28/*.json") -> list[str]:
    """The planner's all-to-all (``moe.a2a_time``) on a CPU calibration of the 2-core VM against gloo's own
    all-to-all measured there on 4 ranks (``shardwise bench comm --ops all_to_all``; median over the stored runs).
    The bench's split is uneven (rank r gives rank j the share 1 + (j − r) % 4 of 10, so 9/10 of a rank's buffer
    leaves it, 3/4 in the planner's even split): the planner is handed the buffer whose off-rank bytes are the
    bench's. Shown with and without the calibration's sync skew (what a collective between pieces of compute
    waits; the bench runs them back to back)."""
    import glob
    import statistics

    from shardwise.planner.moe import a2a_time

    hw = Hardware.load(calibration)
    measured: dict[int, list[float]] = {}
    for path in sorted(glob.glob(runs)):
        for row in json.loads(Path(path).read_text())["results"]:
            if row["op"] == "all_to_all" and row["algorithm"] == "native":
                measured.setdefault(row["nbytes"], []).append(row["time_us"])
    bare = dataclasses.replace(hw, sync_skew_s=0.0)
    lines = ["| bytes per rank | measured µs (median of runs) | planner µs | planner ÷ measured | planner without "
             "the sync skew µs | ÷ measured |", "|---|---|---|---|---|---|"]
    for nbytes, times in sorted(measured.items()):
        seen = statistics.median(times)
        with_skew = a2a_time(hw, nbytes * 0.9 / 0.75, 4, 4) * 1e6
        without = a2a_time(bare, nbytes * 0.9 / 0.75, 4, 4) * 1e6
        lines.append(f"| {nbytes:,} | {seen:,.0f} | {with_skew:,.0f} | {with_skew / seen:.2f} | {without:,.0f} | "
                     f"{without / seen:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/planner_moe_published.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--search", action="store_true", help="also the planner's own best layout (BF16 rows)")
    parser.add_argument("--a2a-check", action="store_true",
                        help="only the all-to-all model against the stored 4-rank CPU measurements")
    parser.add_argument("--markdown", default=None, metavar="FILE", help="also write the tables as markdown")
    parser.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.a2a_check:
        print("\n".join(a2a_check()))
        return 0
    results = rows(args.search)
    lines = _table(results) + _search_lines(results)
    comparable = [r["ratio"] for r in results if r["comparable"]]
    if comparable:
        lines += ["", f"BF16 rows (comparable): predicted / published = "
                      f"{', '.join(f'{x:.2f}' for x in comparable)}"]
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
