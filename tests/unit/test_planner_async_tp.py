"""``Layout.async_tp``: the planner's model of tensor-parallel communication overlapped with the matmuls
(``shardwise/planner/tp_overlap.py``), its plumbing (Layout, search pins, ``shardwise predict``), and the layouts
without it staying what they were."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardwise import cli
from shardwise.planner import Hardware, Layout, ModelSpec, predict
from shardwise.planner.compute import async_tp_times, layer_time
from shardwise.planner.link import Link
from shardwise.planner.search import search
from shardwise.planner.tp_overlap import (chunked_allreduce_exposed, hop_exposed, in_place_pieces, overlap_share,
                                         ring_exposed)

ROOT = Path(__file__).resolve().parents[2]
H100 = Hardware.preset("h100-80g-sxm")


def gpt(n_layer: int = 4, h: int = 4096, a: int = 32, s: int = 4096) -> ModelSpec:
    return ModelSpec.gpt(n_layer=n_layer, n_embd=h, n_head=a, vocab_size=131072, seq_len=s, block_size=s,
                         tie_weights=False, dropout=False)


def unoverlapped(layer, plan: Layout, hw: Hardware, per_node: int) -> float:
    """The tensor-parallel term of one direction without overlap, re-derived here: ``tp_allreduces`` all-reduces
    of the layer's hidden state, each plus the sync skew."""
    nbytes = layer.hidden * plan.micro_batch * (4 if plan.precision == "fp32" else 2)
    one = hw.collective_time("all_reduce", nbytes, plan.tp, per_node=per_node, algorithm="native")
    return layer.tp_allreduces * (one + hw.sync_skew_s)


CASES = [(tp, sp, mb, h) for tp in (2, 4, 8) for sp in (False, True) for mb in (1, 4) for h in (1024, 8192)]


@pytest.mark.parametrize("tp,sp,mb,h", CASES)
def test_exposed_is_between_nothing_and_the_unoverlapped_collectives(tp: int, sp: bool, mb: int, h: int) -> None:
    spec = gpt(h=h, a=32)
    plan = Layout(tp=tp, micro_batch=mb, sequence_parallel=sp, async_tp=True, precision="bf16")
    for layer in spec.layers:
        fwd, bwd = async_tp_times(layer, plan, H100, tp)
        for part in (fwd, bwd):
            assert min(part.exposed, part.contention, part.decomposition) >= 0.0
            assert part.exposed <= unoverlapped(layer, plan, H100, tp) * (1 + 1e-12)
        if layer.kind == "block":  # a block's collectives pair with its matmuls: something is hidden
            assert fwd.exposed < unoverlapped(layer, plan, H100, tp)


def test_nothing_to_hide_under_costs_exactly_the_collective() -> None:
    assert ring_exposed(3.0, 1.0, 7, 0.0, 1.0, 0.1) == pytest.approx((4.0, 0.0))
    # an all-reduce cut into 4 pieces: the whole exposed, 3 more latencies the price of cutting it
    assert chunked_allreduce_exposed(3.0, 1.0, 4, 0.0, 1.0, 0.1) == pytest.approx((4.0, 0.0, 3.0))
    # a hop fully under its matmul leaves its latency, and the GEMM pays for sharing the device
    exposed, contention = ring_exposed(3.0, 1.0, 3, 10.0, 1.0, 0.1)
    assert exposed == pytest.approx(1.0) and contention == pytest.approx(3.0 * 0.1 / 0.9)


@pytest.mark.parametrize("sp", [False, True])
def test_tp_one_is_unchanged_and_refused_by_predict(sp: bool) -> None:
    spec = gpt(n_layer=2, h=1024, a=16, s=512)
    block = spec.layers[1]
    plain = layer_time(block, Layout(micro_batch=2, precision="bf16"), H100, flash=True, tp_per_node=1)
    asked = layer_time(block, Layout(micro_batch=2, precision="bf16", async_tp=True), H100, flash=True,
                       tp_per_node=1)
    assert asked == plain and plain.tp_fwd == plain.tp_bwd == 0.0
    with pytest.raises(ValueError, match="async_tp needs tp > 1"):
        predict(spec, Layout(dp=2, async_tp=True), H100, global_batch=4)


@pytest.mark.parametrize("sp", [False, True])
def test_faster_links_expose_less(sp: bool) -> None:
    block = gpt(h=4096, a=32).layers[1]
    plan = Layout(tp=8, micro_batch=1, sequence_parallel=sp, async_tp=True, precision="bf16")
    last = None
    for gbps in (25, 50, 100, 200, 400, 800, 1600):
        hw = dataclasses.replace(H100, intra=Link(alpha_s=H100.intra.alpha_s, bus_bandwidth_Bps=gbps * 1e9))
        fwd, bwd = async_tp_times(block, plan, hw, 8)
        total = fwd.exposed + bwd.exposed
        assert last is None or total <= last * (1 + 1e-12)
        last = total


def test_layouts_without_async_tp_keep_the_unoverlapped_term() -> None:
    """Every layer's tensor-parallel term of a layout without async_tp is the re-derived unoverlapped one, and
    the layout's prediction does not change when async_tp = False is spelt out."""
    spec = gpt(n_layer=4, h=4096, a=32, s=4096)
    for sp in (False, True):
        plan = Layout(dp=2, tp=4, pp=2, micro_batch=1, sequence_parallel=sp, precision="bf16-mixed")
        for layer in spec.layers:
            t = layer_time(layer, plan, H100, flash=True, tp_per_node=4)
            assert t.tp_fwd == t.tp_bwd == unoverlapped(layer, plan, H100, 4)
        a = predict(spec, plan, H100, global_batch=16)
        b = predict(spec, dataclasses.replace(plan, async_tp=False), H100, global_batch=16)
        assert a.step_time_s == b.step_time_s and a.breakdown == b.breakdown
        with in_place_pieces():  # the overlap alone, its pieces assembled by their GEMMs
            c = predict(spec, dataclasses.replace(plan, async_tp=True), H100, global_batch=16)
        assert c.breakdown["tp_comm"] < a.breakdown["tp_comm"] and c.step_time_s < a.step_time_s
        # as the runtime assembles them today: its partial-sum and concatenation passes cost more
        d = predict(spec, dataclasses.replace(plan, async_tp=True), H100, global_batch=16)
        assert d.step_time_s > c.step_time_s


def test_published_rows_without_overlap_are_priced_without_it() -> None:
    """The 2021-2024 tables (no tp-comm overlap) run their layouts with async_tp False; the Megatron-Core table's
    'before' column is the same layout with async_tp False and its 'after' column the one with it."""
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.planner.published import MEGATRON_TABLE1, megatron_plan
    from benchmarks.planner.published_llama3 import LLAMA3_TABLE4, llama3_plan
    from benchmarks.planner.published_mcore import MCORE_WEAK_SCALING, mcore_prediction

    assert not any(megatron_plan(r.layers, r.tp, r.pp, r.gpus).async_tp for r in MEGATRON_TABLE1)
    assert not any(llama3_plan(r).async_tp for r in LLAMA3_TABLE4)
    row = next(r for r in MCORE_WEAK_SCALING if r.tp == 4)
    before, after = mcore_prediction(row, async_tp=False), mcore_prediction(row, async_tp=True, in_place=True)
    assert not before.plan.async_tp and after.plan.async_tp
    assert after.breakdown["tp_comm"] < before.breakdown["tp_comm"]
    for key in ("pipeline_bubble", "dp_comm", "optimizer"):
        assert after.breakdown[key] == pytest.approx(before.breakdown[key], rel=1e-9)


def test_cpu_ranks_hide_the_wait_not_the_copy() -> None:
    """CPU ranks on every core: a hop's copy takes a core (never hidden), its latency is waiting the matmul runs
    through; nothing to hide under still costs the whole collective."""
    assert hop_exposed(3.0, 1.0, 0.0, 0.0, True) == (4.0, 0.0)
    assert hop_exposed(3.0, 1.0, 10.0, 0.0, True)[0] == 3.0  # the copy stays, the wait hides
    assert hop_exposed(3.0, 1.0, 10.0, 1.0, False)[0] == 1.0  # a GPU: the transfer hides, the latency stays
    hw = Hardware.load(ROOT / "benchmarks" / "hardware_cpu_2ranks.json")
    assert overlap_share(hw, 2) == 0.0 and overlap_share(hw, 1) == 1.0 and overlap_share(H100, 8) == 1.0
    spec = ModelSpec.gpt(n_layer=2, n_embd=256, n_head=8, vocab_size=512, seq_len=128, block_size=128,
                         tie_weights=True, dropout=False)
    plan = Layout(tp=2, micro_batch=4, sequence_parallel=True, async_tp=True)
    hw_d = hw.for_devices(2)
    fwd, bwd = async_tp_times(spec.layers[1], plan, hw_d, 2)
    assert fwd.contention == bwd.contention == 0.0
    # each pair priced as the unoverlapped all-reduce: at least its bandwidth term stays, less than all of it
    coll = lambda nbytes: hw_d.collective_time("all_reduce", nbytes, 2, per_node=2, algorithm="native")  # noqa: E731
    whole, latency = coll(128 * 256 * 4 * 4), coll(1)
    for part in (fwd, bwd):
        assert 2 * (whole - latency) <= part.exposed * (1 + 1e-12) and part.exposed < 2 * whole


def test_layout_prints_and_round_trips_the_flag() -> None:
    plan = Layout(dp=2, tp=4, micro_batch=2, sequence_parallel=True, async_tp=True, precision="bf16")
    assert "sp async-tp" in plan.describe() and "async" not in Layout(tp=4).describe()
    assert Layout.from_json(plan.dumps()) == plan and json.loads(plan.dumps())["async_tp"] is True
    old = {k: v for k, v in Layout(tp=2).to_json().items() if k != "async_tp"}  # a plan saved before the field
    assert Layout.from_json(old).async_tp is False
    with pytest.raises(ValueError, match="async_tp must be a bool"):
        Layout(tp=2, async_tp="yes")  # type: ignore[arg-type]


def test_search_prices_async_tp_when_pinned() -> None:
    spec = gpt(n_layer=8, h=2048, a=16, s=2048)
    plain = search(spec, H100, devices=16, global_batch=64, pins={"precision": "bf16-mixed", "tp": 4}, top=2)
    pinned = search(spec, H100, devices=16, global_batch=64, pins={"precision": "bf16-mixed", "tp": 4,
                                                                   "async_tp": True}, top=2)
    assert not any(p.plan.async_tp for p in plain) and all(p.plan.async_tp for p in pinned)
    with pytest.raises(ValueError, match="async_tp true and tp 1 contradict"):
        search(spec, H100, devices=16, global_batch=64, pins={"tp": 1, "async_tp": True})


def test_predict_cli_takes_parallel_async_tp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["predict", "--model.n_layer", "4", "--model.n_embd", "1024", "--model.n_head", "16",
            "--model.vocab_size", "32000", "--model.block_size", "2048", "--parallel.nproc", "8", "--parallel.tp",
            "4", "--parallel.sequence_parallel", "true", "--parallel.micro_batch", "1", "--data.global_batch", "8",
            "--train.precision", "bf16", "--hardware", "h100-80g-sxm", "--json"]
    outs = []
    for flag in ("false", "true"):
        assert cli.main(argv + ["--parallel.async_tp", flag]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0]["plan"]["async_tp"] is False and outs[1]["plan"]["async_tp"] is True
    assert outs[1]["breakdown"]["tp_comm"] != outs[0]["breakdown"]["tp_comm"]
    assert outs[1]["breakdown"]["pipeline_bubble"] == outs[0]["breakdown"]["pipeline_bubble"]


def test_bench_ratio_on_the_cpu_calibrations() -> None:
    """``benchmarks/planner/async_tp_ratio.py``: the parts of the overlapped step add up to its difference from
    the unoverlapped twin."""
    import sys

    sys.path.insert(0, str(ROOT))
    from benchmarks.planner.async_tp_ratio import bench_tp_ratio, ratio_lines

    rows = [(f"{n} ranks", bench_tp_ratio(str(ROOT / "benchmarks" / f"hardware_cpu_{n}ranks.json"), tp=n))
            for n in (2, 4)]
    for n, (_, r) in zip((2, 4), rows):
        p = r.parts
        assert 0.5 < r.ratio < 1.5 and p["exposed"] <= p["unoverlapped"]
        # both keep one sync skew per collective pair: 2 blocks × 2 pairs × forward and backward
        skew = 8 * Hardware.load(ROOT / "benchmarks" / f"hardware_cpu_{n}ranks.json").sync_skew_s
        parts = p["exposed"] + p["contention"] + p["decomposition"] + p["accumulation"]
        assert r.async_s - r.sync_s == pytest.approx(parts + skew - p["unoverlapped"], rel=1e-9)
    lines, data = ratio_lines(rows)
    assert len(lines) == 4 and data[1]["tp"] == 4
