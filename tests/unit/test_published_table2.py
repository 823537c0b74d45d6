"""The planner against Narayanan et al. 2021 (arXiv 2104.04473) Table 2 (§5.2): PTD-P vs ZeRO-3 without model
parallelism, GPT 175B and 530B on 384 to 2240 A100s at a fixed global batch (pure, seconds).

Every expected number here is the paper's (its table, its text, its Eqs. 2-4), never the planner's own output.
The ZeRO-3 rows are DeepSpeed's (2021) and the planner does not reproduce their throughput (it predicts them 1.4x
to 3x faster, see ``python benchmarks/planner_published.py``); only the direction of their scaling is asserted."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache

import pytest

from shardwise.planner.predict import Prediction
from benchmarks.planner.published import (NARAYANAN_TABLE2, NARAYANAN_TABLE2_MODELS, NarayananTable2Row,
                                         narayanan_table2_days, narayanan_table2_plan, narayanan_table2_prediction)

PTD = tuple(r for r in NARAYANAN_TABLE2 if r.scheme == "PTD-P")
ZERO = tuple(r for r in NARAYANAN_TABLE2 if r.scheme == "ZeRO-3")

# GPT-3 on 1536 GPUs: the planner's interleaved schedule (2 chunks, Table 1's assumption) predicts 155.9 TF/s,
# +10.6 % over the published 141. Its predicted fall from 384 to 1536 GPUs (-5.5 %) is shallower than the
# paper's (-7.8 %): at 96 micro-batches per pipeline the interleaved bubble (11 / 192) is half the plain one; the
# same row with plain 1F1B is +6.4 % (checked below). Left out of the ±10 % assertion for the interleaved plan.
OUTSIDE_10_PERCENT = {(174.6, 1536)}


def _id(row: NarayananTable2Row) -> str:
    return f"{row.scheme}-{row.params_b:.0f}B-{row.gpus}gpu"


@lru_cache(maxsize=None)
def _pred(row: NarayananTable2Row, runtime: str = "megatron", schedule: str = "interleaved") -> Prediction:
    return narayanan_table2_prediction(row, runtime, schedule)


def _row(scheme: str, params_b: float, gpus: int) -> NarayananTable2Row:
    return next(r for r in NARAYANAN_TABLE2 if (r.scheme, r.params_b, r.gpus) == (scheme, params_b, gpus))


@pytest.mark.parametrize("row", [r for r in PTD if (r.params_b, r.gpus) not in OUTSIDE_10_PERCENT], ids=_id)
def test_ptdp_throughput_within_10_percent(row: NarayananTable2Row) -> None:
    got = _pred(row).tflops_per_device
    assert abs(got / row.tflops - 1) <= 0.10, (row, got)


@pytest.mark.parametrize("row", PTD, ids=_id)
def test_ptdp_throughput_within_10_percent_with_plain_1f1b(row: NarayananTable2Row) -> None:
    # §5.2 names no schedule: the plain one is the other reading, and it holds on every row
    got = _pred(row, schedule="1f1b").tflops_per_device
    assert abs(got / row.tflops - 1) <= 0.10, (row, got)


@pytest.mark.parametrize("params_b, gpus", [(174.6, 1536), (529.6, 2240),
    pytest.param(174.6, 768, marks=pytest.mark.xfail(strict=True, reason="predicted ZeRO-3 faster than PTD-P: "
                 "the planner prices ZeRO-3's gathers at the preset's 180 GB/s, the paper measured 88 vs 149")),
    pytest.param(529.6, 1120, marks=pytest.mark.xfail(strict=True, reason="predicted ZeRO-3 faster than PTD-P: "
                 "the planner prices ZeRO-3's gathers at the preset's 180 GB/s, the paper measured 98 vs 167"))])
def test_ptdp_beats_zero3_on_the_doubled_gpu_counts(params_b: float, gpus: int) -> None:
    # §5.2 / Fig. 10: at the larger GPU counts PTD-P outperforms ZeRO-3 (by 70 % once the GPUs double)
    ptd, zero = _pred(_row("PTD-P", params_b, gpus)), _pred(_row("ZeRO-3", params_b, gpus))
    assert ptd.tflops_per_device > zero.tflops_per_device, (ptd.tflops_per_device, zero.tflops_per_device)


@pytest.mark.parametrize("params_b, counts", [(174.6, (384, 768, 1536)), (529.6, (1120, 2240))])
def test_zero3_throughput_falls_as_gpus_double_at_a_fixed_batch(params_b: float, counts: tuple[int, ...]) -> None:
    # the paper's direction (144 → 88 → 44, 98 → 48): the per-GPU parameter traffic stays while compute halves
    rows = [_row("ZeRO-3", params_b, n) for n in counts]
    assert len({r.batch for r in rows}) == 1
    got = [_pred(r).tflops_per_device for r in rows]
    assert all(a > b for a, b in zip(got, got[1:])), got
    assert all(a.tflops > b.tflops for a, b in zip(rows, rows[1:]))


def test_memory_matches_the_papers_footnote() -> None:
    # Table 2's footnote: 530B with ZeRO-3 at micro-batch 4 did not fit on 560 GPUs; every PTD-P row ran
    star = next(r for r in ZERO if r.params_b == 529.6 and r.micro_batch == 4)
    assert not narayanan_table2_prediction(replace(star, gpus=560, batch=2240)).fits
    assert all(_pred(r).fits for r in PTD)


def test_the_transcribed_numbers_agree_with_the_papers_formulas() -> None:
    # Eq. 2 gives the parameter counts; the days column is T · F / (B · s) / (n · X) with Eq. 3's F (to the
    # table's rounding: about 1 %); Eq. 4's 8 T P / (n X) drops Eq. 3's small terms, so it runs 1-3.5 % lower
    s, v, tokens = 2048, 51200, 300e9
    for params_b, (layers, h, _) in NARAYANAN_TABLE2_MODELS.items():
        assert 12 * layers * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * layers * h)) / 1e9 == pytest.approx(
            params_b, abs=0.05)
    for r in NARAYANAN_TABLE2:
        layers, h, _ = NARAYANAN_TABLE2_MODELS[r.params_b]
        per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        eq3_days = tokens * per_token / (r.gpus * r.tflops * 1e12) / 86400
        eq4_days = 8 * tokens * r.params_b * 1e9 / (r.gpus * r.tflops * 1e12) / 86400
        assert eq3_days == pytest.approx(r.days, rel=0.015), (r, eq3_days)
        assert 0.96 <= eq4_days / r.days <= 0.995, (r, eq4_days)
    # §5.2's text: with fewer GPUs (micro-batch 4) PTD-P is 6 % and 24 % faster; doubling the GPUs, 70 %
    assert _row("PTD-P", 174.6, 384).tflops / _row("ZeRO-3", 174.6, 384).tflops == pytest.approx(1.06, abs=0.005)
    assert _row("PTD-P", 529.6, 560).tflops / _row("ZeRO-3", 529.6, 640).tflops == pytest.approx(1.24, abs=0.005)
    for params_b, gpus in ((174.6, 768), (529.6, 1120)):
        assert _row("PTD-P", params_b, gpus).tflops / _row("ZeRO-3", params_b, gpus).tflops == pytest.approx(
            1.70, abs=0.01)


def test_layouts_follow_the_table() -> None:
    # model-parallel 96 = tp 8 × pp 12 and 280 = tp 8 × pp 35 (tp 8 assumed); ZeRO-3 is data parallel on every GPU
    for r in PTD:
        plan = narayanan_table2_plan(r)
        assert (plan.tp * plan.pp, plan.devices, plan.micro_batch) == (r.model_parallel, r.gpus, 1), r
        assert plan.schedule == "interleaved" and plan.activation_checkpointing == "full"
        assert narayanan_table2_plan(r, "1f1b").schedule == "1f1b"
    for r in ZERO:
        plan = narayanan_table2_plan(r)
        assert (plan.dp, plan.tp, plan.pp, plan.zero_stage, plan.micro_batch) == (r.gpus, 1, 1, 3, r.micro_batch)
    with pytest.raises(ValueError, match="schedule"):
        narayanan_table2_plan(PTD[0], "gpipe")


def test_predicted_days_are_the_token_rate_over_300b_tokens() -> None:
    pred = _pred(PTD[0])
    assert narayanan_table2_days(pred) == pytest.approx(300e9 / pred.tokens_per_s / 86400)
