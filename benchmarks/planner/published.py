"""Published measurements the planner is checked against (numbers only; each row cites its table).

Used by the unit tests and by ``python benchmarks/planner_published.py`` (which regenerates the tables in
``benchmarks/RESULTS.md``); not part of the installed package. Assumptions the papers do not state are named
where they are made.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwise.planner.hardware import Hardware
from shardwise.planner.plan import Layout
from shardwise.planner.predict import Prediction, predict
from shardwise.planner.spec import ModelSpec

__all__ = ["MegatronRow", "MEGATRON_TABLE1", "megatron_prediction", "GPT3_175B_DAYS", "GPT3_175B_LAYOUT",
           "gpt3_plan", "gpt3_days", "ZERO_TABLE1", "KorthikantiRow", "KORTHIKANTI_TABLE5", "KORTHIKANTI_530B_DP8",
           "KORTHIKANTI_METHODS", "korthikanti_plan", "korthikanti_published_s", "korthikanti_prediction",
           "NarayananTable2Row", "NARAYANAN_TABLE2", "NARAYANAN_TABLE2_MODELS", "NARAYANAN_TABLE2_TP",
           "NARAYANAN_TABLE2_TOKENS", "narayanan_table2_plan", "narayanan_table2_prediction", "narayanan_table2_days",
           "zero3_implied_bus_bandwidth"]


@dataclass(frozen=True)
class MegatronRow:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float
    """Measured TF/s per GPU (Eq. 3 FLOPs, full recomputation)."""


# Narayanan et al. 2021 (arXiv 2104.04473), Table 1: A100-80GB (Selene), seq 2048, vocab 51,200, full activation
# recomputation, interleaved schedule, mixed precision.
MEGATRON_TABLE1 = (
    MegatronRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137), MegatronRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    MegatronRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142), MegatronRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    MegatronRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), MegatronRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    MegatronRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), MegatronRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    MegatronRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    MegatronRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
)

GPT3_175B_DAYS = 34.0
"""Narayanan et al. 2021 §5.1: GPT-3 175B, 300B tokens, 1024 A100s, batch 1536 → about 34 days."""

ZERO_TABLE1 = {"params": 7.5e9, "dp": 64, "gb": {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.88}}
"""Rajbhandari et al. 2019 (arXiv 1910.02054) Table 1: model-state GB per device, 7.5B params, N_d = 64, K = 12."""


def megatron_spec(layers: int, hidden: int, heads: int) -> ModelSpec:
    """Megatron-LM's 2021 GPT: unfused attention with dropout, vocab 51,200, seq 2048."""
    return ModelSpec.gpt(n_layer=layers, n_embd=hidden, n_head=heads, vocab_size=51200, seq_len=2048,
                         block_size=2048, attention="unfused", dropout=True, name=f"gpt-{hidden}x{layers}")


def megatron_plan(layers: int, tp: int, pp: int, gpus: int) -> Layout:
    """The row's layout. Not in the table, assumed: micro-batch 1, two model chunks per pipeline rank (three
    when the layers per rank do not split in two), bf16-mixed precision (2 + 2 + 12 bytes per parameter)."""
    chunks = 1 if pp == 1 else (2 if layers % (2 * pp) == 0 else 3)
    return Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=1, schedule="interleaved" if pp > 1 else "1f1b",
                chunks=chunks, activation_checkpointing="full", precision="bf16-mixed")


def megatron_prediction(row: MegatronRow, hw: Hardware | None = None) -> Prediction:
    """The planner's prediction for one Table 1 row on the ``a100-80g-sxm`` preset."""
    hw = hw or Hardware.preset("a100-80g-sxm")
    return predict(megatron_spec(row.layers, row.hidden, row.heads), megatron_plan(row.layers, row.tp, row.pp, row.gpus),
                   hw, global_batch=row.batch, runtime="megatron")


GPT3_175B_LAYOUT = {"tp": 8, "pp": 16, "schedule": "1f1b", "micro_batch": 1}
"""The layout of NVIDIA/Megatron-LM's own GPT-3 175B launch script of the paper's time
(``examples/pretrain_gpt3_175B.sh``: 128 nodes × 8 GPUs, tensor parallel 8, pipeline parallel 16, micro-batch 1,
global batch 1536, fp16, activation checkpointing, no virtual pipeline stages — so the non-interleaved 1F1B).
§5.1 of the paper does not state the layout behind its 140 TF/s; this script is the published one."""


def gpt3_plan() -> Layout:
    """GPT-3 175B on 1024 GPUs in ``GPT3_175B_LAYOUT`` (data parallel 8)."""
    lay = GPT3_175B_LAYOUT
    return Layout(dp=1024 // (lay["tp"] * lay["pp"]), tp=lay["tp"], pp=lay["pp"], micro_batch=lay["micro_batch"],
                schedule=lay["schedule"], activation_checkpointing="full", precision="bf16-mixed")


def gpt3_days(hw: Hardware | None = None) -> tuple[float, Prediction]:
    """Predicted days to train GPT-3 175B on 300B tokens with 1024 A100s, batch 1536, in ``GPT3_175B_LAYOUT``."""
    hw = hw or Hardware.preset("a100-80g-sxm")
    pred = predict(megatron_spec(96, 12288, 96), gpt3_plan(), hw, global_batch=1536, runtime="megatron")
    return 300e9 / pred.tokens_per_s / 86400, pred


@dataclass(frozen=True)
class KorthikantiRow:
    """One configuration of Korthikanti et al. 2022 (Table 3 layout, Table 5 measurements)."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    micro_batch: int
    chunks: int
    """Interleaving stages m per pipeline rank; 1 = the plain 1F1B schedule."""
    full_s: float | None
    """Iteration seconds with full recomputation and no sequence parallelism (None: not published)."""
    present_s: float
    """Iteration seconds with sequence parallelism + selective recomputation (the paper's "present work")."""
    mfu: float
    """Model FLOPs utilisation of the present-work run, % of the 312 TF/s bf16 peak."""
    hfu: float | None
    """Hardware FLOPs utilisation of the present-work run, % (None: not published)."""
    full_mfu: float | None = None
    """MFU of the full-recomputation run, % (only the 2240-GPU run publishes it, in the abstract)."""


# Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198):
# Table 3 (layouts) and Table 5 (iteration time, MFU, HFU). §6: A100-80GB (Selene), seq 2048, vocab 51,200,
# mixed precision, no data parallelism, the interleaved schedule with m = 3 for the 175B and 530B models.
# Not stated, assumed: plain 1F1B for the 1T model (§6 names m = 3 only for 175B and 530B, and two layers per
# rank cannot be cut in three), bf16-mixed (2 + 2 + 12 bytes per parameter; the paper says "mixed precision").
KORTHIKANTI_TABLE5 = (
    KorthikantiRow("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10, 41.5, 43.7),
    KorthikantiRow("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75, 51.4, 52.8),
    KorthikantiRow("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83, 56.0, 57.0),
    KorthikantiRow("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49, 56.3, 57.0),
)

KORTHIKANTI_530B_DP8 = KorthikantiRow("530B", 128, 20480, 105, 8, 35, 2240, 2240, 1, 3, None, 39.15, 54.2, None, 42.1)
"""The same paper, §6.3 and abstract: the 530B row with 8-way data parallelism (2240 GPUs, batch × 8) runs an
iteration in 39.15 s at MFU 54.2 %; full recomputation reaches MFU 42.1 % there (its time is not given)."""

KORTHIKANTI_METHODS = ("full", "present")
"""Table 5's two columns: full recomputation without sequence parallelism; sequence parallelism + selective."""


def korthikanti_published_s(row: KorthikantiRow, method: str) -> float:
    """The row's published iteration seconds for ``method``. The 2240-GPU full-recomputation time is not
    published; MFU is model FLOPs / (time × GPUs × peak) (§6.3), so at equal FLOPs it is the present-work time
    scaled by the ratio of the two published MFUs."""
    if method not in KORTHIKANTI_METHODS:
        raise ValueError(f"method must be one of {list(KORTHIKANTI_METHODS)}, got {method!r}")
    if method == "present":
        return row.present_s
    if row.full_s is not None:
        return row.full_s
    if row.full_mfu is None:
        raise ValueError(f"row {row.name} on {row.gpus} GPUs publishes neither a full-recomputation time nor its MFU")
    return row.present_s * row.mfu / row.full_mfu


def korthikanti_plan(row: KorthikantiRow, method: str) -> Layout:
    """The row's layout under ``method``: ``full`` recomputes every block without sequence parallelism,
    ``present`` recomputes only the attention core with sequence parallelism (the paper's Table 5 columns)."""
    if method not in KORTHIKANTI_METHODS:
        raise ValueError(f"method must be one of {list(KORTHIKANTI_METHODS)}, got {method!r}")
    present = method == "present"
    return Layout(dp=row.gpus // (row.tp * row.pp), tp=row.tp, pp=row.pp, micro_batch=row.micro_batch,
                schedule="interleaved" if row.chunks > 1 else "1f1b", chunks=row.chunks,
                activation_checkpointing="selective" if present else "full", sequence_parallel=present,
                precision="bf16-mixed")


def korthikanti_prediction(row: KorthikantiRow, method: str, hw: Hardware | None = None) -> Prediction:
    """The planner's prediction for one row and method on the ``a100-80g-sxm`` preset. ``megatron`` runtime:
    §6.3 says the data-parallel all-reduce is not overlapped with back-propagation."""
    hw = hw or Hardware.preset("a100-80g-sxm")
    return predict(megatron_spec(row.layers, row.hidden, row.heads), korthikanti_plan(row, method), hw,
                   global_batch=row.batch, runtime="megatron")


@dataclass(frozen=True)
class NarayananTable2Row:
    """One row of Narayanan et al. 2021 Table 2: PTD-P or ZeRO-3 without model parallelism."""

    scheme: str
    """``PTD-P`` (the paper's tensor + pipeline + data parallelism) or ``ZeRO-3`` (DeepSpeed, no model parallelism)."""
    params_b: float
    model_parallel: int
    """Model-parallel size t × p (1 for ZeRO-3; the table does not split it, see ``NARAYANAN_TABLE2_TP``)."""
    batch: int
    gpus: int
    micro_batch: int
    tflops: float
    """Achieved TF/s per GPU (Eq. 3 FLOPs: activation recomputation counted)."""
    days: float
    """The paper's training days for 300B tokens (its Eq. 3 FLOPs at ``tflops``)."""


# Narayanan et al. 2021 (arXiv 2104.04473), Table 2 and §5.2: GPT-3 175B (174.6B: 96 layers, h 12288, 96 heads) and
# the 530B model of Table 1 (529.6B: 105 layers, h 20480, 128 heads), seq 2048, vocab 51,200, A100-80GB (Selene),
# mixed precision (§5), global batch fixed per model as GPUs double. ZeRO-3 ran through the DeepSpeed library in
# Megatron's code base (§5.2: no version, no overlap or checkpointing settings given). The 2560-batch row is the
# table's starred one: 530B with ZeRO-3 at micro-batch 4 did not fit on 560 GPUs, so it ran on 640 with batch 2560.
NARAYANAN_TABLE2 = (
    NarayananTable2Row("ZeRO-3", 174.6, 1, 1536, 384, 4, 144, 90),
    NarayananTable2Row("ZeRO-3", 174.6, 1, 1536, 768, 2, 88, 74),
    NarayananTable2Row("ZeRO-3", 174.6, 1, 1536, 1536, 1, 44, 74),
    NarayananTable2Row("ZeRO-3", 529.6, 1, 2560, 640, 4, 138, 169),
    NarayananTable2Row("ZeRO-3", 529.6, 1, 2240, 1120, 2, 98, 137),
    NarayananTable2Row("ZeRO-3", 529.6, 1, 2240, 2240, 1, 48, 140),
    NarayananTable2Row("PTD-P", 174.6, 96, 1536, 384, 1, 153, 84),
    NarayananTable2Row("PTD-P", 174.6, 96, 1536, 768, 1, 149, 43),
    NarayananTable2Row("PTD-P", 174.6, 96, 1536, 1536, 1, 141, 23),
    NarayananTable2Row("PTD-P", 529.6, 280, 2240, 560, 1, 171, 156),
    NarayananTable2Row("PTD-P", 529.6, 280, 2240, 1120, 1, 167, 80),
    NarayananTable2Row("PTD-P", 529.6, 280, 2240, 2240, 1, 159, 42),
)

NARAYANAN_TABLE2_MODELS = {174.6: (96, 12288, 96), 529.6: (105, 20480, 128)}
"""Table 2's two models: params (billion) → (layers, hidden, heads), from §5.3.2 (GPT-3) and Table 1 (530B)."""

NARAYANAN_TABLE2_TP = 8
"""Not in Table 2, assumed: tensor parallel 8 (one DGX A100 node, §5.4.1's best and every large row of Table 1),
so model-parallel 96 = 8 × pp 12 and 280 = 8 × pp 35 (Table 1's 530B layout)."""

NARAYANAN_TABLE2_TOKENS = 300e9


def narayanan_table2_plan(row: NarayananTable2Row, schedule: str = "interleaved") -> Layout:
    """The row's layout. PTD-P: tp 8 (assumed) × pp, data parallel over the rest, micro-batch 1 (the table's),
    full recomputation. ``interleaved`` (default) is ``megatron_plan``'s assumption for Table 1 — §5.1 states the
    interleaved schedule for the end-to-end runs, §5.2 names none — with 2 chunks for 175B (8 layers per rank)
    and 3 for 530B (3 per rank); ``1f1b`` is the plain schedule, for the sensitivity. ZeRO-3: data parallel over
    every GPU at the table's micro-batch, full recomputation (assumed: Table 2's TF/s are Eq. 3's, which counts
    a recomputed forward), bf16-mixed (2 + 2 + 12 bytes per parameter)."""
    if row.scheme == "ZeRO-3":
        return Layout(dp=row.gpus, micro_batch=row.micro_batch, zero_stage=3, activation_checkpointing="full",
                    precision="bf16-mixed")
    if schedule not in ("interleaved", "1f1b"):
        raise ValueError(f"schedule must be 'interleaved' or '1f1b', got {schedule!r}")
    layers, pp = NARAYANAN_TABLE2_MODELS[row.params_b][0], row.model_parallel // NARAYANAN_TABLE2_TP
    if schedule == "interleaved":
        return megatron_plan(layers, NARAYANAN_TABLE2_TP, pp, row.gpus)
    return Layout(dp=row.gpus // row.model_parallel, tp=NARAYANAN_TABLE2_TP, pp=pp, micro_batch=1, schedule="1f1b",
                activation_checkpointing="full", precision="bf16-mixed")


def narayanan_table2_prediction(row: NarayananTable2Row, runtime: str = "megatron", schedule: str = "interleaved",
                                hw: Hardware | None = None) -> Prediction:
    """The planner's prediction for one Table 2 row on the ``a100-80g-sxm`` preset.

    ``megatron`` runtime for every row, ZeRO-3 included: nothing overlapped — the ZeRO-3 numbers are
    DeepSpeed's (2021), whose prefetch and overlap the planner does not model, so this is its only runtime
    that claims nothing about them. ``shardwise`` prices the same ZeRO-3 plan with the gathers and
    reduce-scatters hidden under compute as far as it covers them (the planner's model of our own runtime): an
    optimistic bound for comparison, not the paper's system."""
    hw = hw or Hardware.preset("a100-80g-sxm")
    layers, hidden, heads = NARAYANAN_TABLE2_MODELS[row.params_b]
    return predict(megatron_spec(layers, hidden, heads), narayanan_table2_plan(row, schedule), hw,
                   global_batch=row.batch, runtime=runtime)


def narayanan_table2_days(pred: Prediction) -> float:
    """Predicted days for the paper's 300B tokens at the prediction's token rate (as ``gpt3_days``)."""
    return NARAYANAN_TABLE2_TOKENS / pred.tokens_per_s / 86400


def zero3_implied_bus_bandwidth(row: NarayananTable2Row, pred: Prediction) -> float:
    """Bytes per second per GPU at which a ZeRO-3 row's traffic would fill the published step: per step each GPU
    moves (P - 1)/P of 3 × 2 B × Ψ (two bf16 parameter all-gathers, one gradient reduce-scatter per pass);
    the published step is the prediction's FLOPs at the published TF/s; everything it has beyond the predicted
    compute and optimizer is charged to that traffic, unoverlapped (latency folded in)."""
    if row.scheme != "ZeRO-3":
        raise ValueError(f"only ZeRO-3 rows have a parameter-gather traffic, got {row.scheme!r}")
    published_s = pred.step_time_s * pred.tflops_per_device / row.tflops
    left = published_s - (pred.step_time_s - pred.breakdown["dp_comm"])
    traffic = pred.plan.grad_accum * 3 * 2 * row.params_b * 1e9 * (row.gpus - 1) / row.gpus
    return traffic / left if left > 0 else float("inf")

