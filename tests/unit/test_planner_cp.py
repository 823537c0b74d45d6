"""Context parallelism (``Layout.cp``, ring attention) in the planner: the layout, its costs, the search and the
published Llama 3 rows (pure, seconds)."""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache

import pytest

from shardwise.planner import Hardware, Layout, Link, ModelSpec, NoFeasiblePlan, predict, search
from shardwise.planner.compute import attention_time
from shardwise.planner.context import ring_times
from shardwise.planner.enumerate import Space, candidates
from shardwise.planner.predict import layer_costs, local_spec
from benchmarks.planner.published import MEGATRON_TABLE1, megatron_prediction, megatron_spec
from benchmarks.planner.published_llama3 import LLAMA3_TABLE4, Llama3Row, llama3_prediction, model_tflops

A100 = Hardware.preset("a100-80g-sxm")
H100 = Hardware.preset("h100-80g-sxm")


def llama(seq: int, layers: int = 4) -> ModelSpec:
    return ModelSpec.llama(n_layer=layers, hidden=1024, heads=16, kv_heads=4, ffn=2816, vocab_size=32000, seq_len=seq,
                           name="llama-small")


# -- the layout ---------------------------------------------------------------------------------------------------
def test_layout_cp_round_trips_and_counts_devices():
    plan = Layout(dp=2, cp=4, tp=2, pp=2, zero_stage=1, precision="bf16-mixed")
    assert plan.devices == 32 and plan.zero_group == 8
    assert Layout.from_json(json.loads(plan.dumps())) == plan
    assert "cp=4" in plan.describe() and "cp=" not in Layout(dp=2).describe()
    assert Layout(dp=2) == Layout(dp=2, cp=1)


@pytest.mark.parametrize("cp", [0, -1, 1.5, True])
def test_layout_cp_must_be_a_positive_int(cp):
    with pytest.raises(ValueError, match="Layout.cp must be an int >= 1"):
        Layout(cp=cp)


def test_sequence_must_split_into_two_chunks_per_cp_rank():
    with pytest.raises(ValueError, match=r"cp = 4 needs the sequence length divisible by 2·cp = 8.*got 1020"):
        predict(llama(1020), Layout(cp=4), H100, global_batch=1)


# -- cp = 1 is the planner as it was ------------------------------------------------------------------------------
CASES = [
    (ModelSpec.gpt(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, seq_len=1024), A100,
     dict(dp=2, tp=2, pp=2, schedule="1f1b"), 16, "shardwise"),
    (ModelSpec.gpt(n_layer=4, n_embd=512, n_head=8, vocab_size=8192, seq_len=1024), H100,
     dict(dp=4, zero_stage=3, activation_checkpointing="full"), 16, "shardwise"),
    (llama(4096), Hardware.preset("h200-141g-sxm"), dict(dp=2, tp=4, sequence_parallel=True,
                                                         activation_checkpointing="selective", precision="bf16"), 8,
     "megatron"),
]


@pytest.mark.parametrize("spec, hw, fields, batch, runtime", CASES)
def test_cp_1_predicts_exactly_what_a_layout_without_cp_does(spec, hw, fields, batch, runtime):
    without = predict(spec, Layout(**fields), hw, global_batch=batch, runtime=runtime)
    with_cp = predict(spec, Layout(**fields, cp=1), hw, global_batch=batch, runtime=runtime)
    assert with_cp.to_json() == without.to_json()
    assert "cp_comm" not in without.breakdown


def test_published_megatron_rows_unchanged_by_the_default():
    row = MEGATRON_TABLE1[2]
    pred = megatron_prediction(row)
    again = predict(megatron_spec(row.layers, row.hidden, row.heads), dataclasses.replace(pred.plan, cp=1), A100,
                    global_batch=row.batch, runtime="megatron")
    assert again.to_json() == pred.to_json()


# -- costs --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 4, 8])
def test_activations_scale_with_one_over_cp_and_states_do_not(cp):
    spec = llama(16384)
    one = predict(spec, Layout(dp=1, precision="bf16-mixed"), H100, global_batch=1)
    many = predict(spec, Layout(dp=1, cp=cp, precision="bf16-mixed"), H100, global_batch=1)
    assert many.memory.activations == pytest.approx(one.memory.activations / cp, rel=1e-9)
    assert (many.memory.params, many.memory.grads, many.memory.optimizer) == (
        one.memory.params, one.memory.grads, one.memory.optimizer)  # replicated over cp without ZeRO


def test_zero_shards_over_dp_times_cp():
    spec = llama(8192)
    base = predict(spec, Layout(dp=1, precision="bf16-mixed"), H100, global_batch=2)
    for stage, sharded in ((1, ("optimizer",)), (2, ("optimizer", "grads")), (3, ("optimizer", "grads", "params"))):
        by_cp = predict(spec, Layout(dp=1, cp=4, zero_stage=stage, precision="bf16-mixed"), H100, global_batch=2)
        by_dp = predict(spec, Layout(dp=2, cp=2, zero_stage=stage, precision="bf16-mixed"), H100, global_batch=2)
        for term in ("params", "grads", "optimizer"):
            want = getattr(base.memory, term) / (4 if term in sharded else 1)
            assert getattr(by_cp.memory, term) == pytest.approx(want, rel=1e-12), (stage, term)
            assert getattr(by_dp.memory, term) == pytest.approx(want, rel=1e-12), (stage, term)
    # and the gradient reduction runs over the dp × cp group
    assert predict(spec, Layout(dp=1, cp=4), H100, global_batch=1).breakdown["dp_comm"] > 0


@pytest.mark.parametrize("cp", [2, 4, 16])
def test_attention_flops_per_device_scale_with_one_over_cp(cp):
    spec, plan = llama(32768), Layout(cp=cp)
    one = layer_costs(spec, Layout(), H100)
    many = layer_costs(local_spec(spec, plan), plan, H100)
    attn = lambda costs: sum(c.flops_attn for c in costs)  # noqa: E731
    gemms = lambda costs: sum(c.flops_fwd - c.flops_attn for c in costs)  # noqa: E731
    assert attn(many) == pytest.approx(attn(one) / cp, rel=1e-12)
    assert gemms(many) == pytest.approx(gemms(one) / cp, rel=1e-12)
    # the whole step's FLOPs are the same work, however it is split
    p1 = predict(spec, Layout(dp=cp), H100, global_batch=cp)
    pc = predict(spec, plan, H100, global_batch=1)
    work = lambda p: p.tflops_per_device * p.plan.devices * p.step_time_s / p.plan.grad_accum  # noqa: E731
    assert work(pc) * cp == pytest.approx(work(p1), rel=1e-9)


def _slow(hw: Hardware, bw: float) -> Hardware:
    return dataclasses.replace(hw, intra=Link(alpha_s=hw.intra.alpha_s, bus_bandwidth_Bps=bw),
                               inter=Link(alpha_s=hw.inter.alpha_s, bus_bandwidth_Bps=bw))


def test_ring_hides_under_block_compute_when_the_link_keeps_up():
    spec, cp = llama(65536), 4
    pred = predict(spec, Layout(cp=cp), H100, global_batch=1)
    blocks = spec.blocks
    # only the first hop's latency in forward and in backward of each block is left
    assert pred.breakdown["cp_comm"] == pytest.approx(blocks * 2 * H100.p2p_alpha_s, rel=1e-9)


def test_ring_is_exposed_on_a_slow_link():
    spec, cp, plan = llama(8192), 4, Layout(cp=4)
    slow = _slow(H100, 1e8)  # 100 MB/s
    pred = predict(spec, plan, slow, global_batch=1)
    block = next(layer for layer in local_spec(spec, plan).layers if layer.kind == "block")
    attn_f, attn_b = attention_time(block, plan, slow, flash=True)
    nbytes = 1 * (8192 // cp) * 2 * (4 * 64) * 4  # b · S/cp · 2 · hkv·hd elements of 4 bytes (fp32), tp 1
    hop = slow.p2p_time(nbytes, cross_node=False)
    assert hop > attn_f / cp and hop > attn_b / cp  # the case is what it claims
    fwd = slow.p2p_alpha_s + (cp - 1) * (hop - attn_f / cp)
    bwd = (slow.p2p_alpha_s + (cp - 1) * (slow.p2p_time(2 * nbytes, cross_node=False) - attn_b / cp)
           + hop - attn_b / cp)  # an fp32 plan: dK/dV are as many bytes as K/V
    assert pred.breakdown["cp_comm"] == pytest.approx(spec.blocks * (fwd + bwd), rel=1e-9)
    assert pred.breakdown["cp_comm"] > 100 * predict(spec, plan, H100, global_batch=1).breakdown["cp_comm"]


def test_ring_times_overlap_rule():
    hw = H100
    hop = hw.p2p_time(1e6, cross_node=False)
    fwd, bwd = ring_times(kv_elements=1e6, elem_bytes=1, cp=4, tp=1, attn_fwd_s=4 * hop * 2, attn_bwd_s=4 * hop * 8,
                          hw=hw)
    assert (fwd, bwd) == (hw.p2p_alpha_s, hw.p2p_alpha_s)  # every hop hidden (dK/dV travel in fp32: 4× K/V here)
    _, bwd = ring_times(kv_elements=1e6, elem_bytes=1, cp=4, tp=1, attn_fwd_s=0.0, attn_bwd_s=0.0, hw=hw)
    both, last = hw.p2p_time(5e6, cross_node=False), hw.p2p_time(4e6, cross_node=False)
    assert bwd == pytest.approx(hw.p2p_alpha_s + 3 * both + last)
    fwd, _ = ring_times(kv_elements=1e6, elem_bytes=1, cp=4, tp=1, attn_fwd_s=0.0, attn_bwd_s=0.0, hw=hw)
    assert fwd == pytest.approx(hw.p2p_alpha_s + 3 * hop)  # nothing to hide under
    assert ring_times(kv_elements=1e6, elem_bytes=1, cp=1, tp=1, attn_fwd_s=0, attn_bwd_s=0, hw=hw) == (0.0, 0.0)


def test_cp_group_across_nodes_uses_the_nic():
    spec = llama(16384)
    slow_nic = dataclasses.replace(H100, inter=Link(alpha_s=5e-6, bus_bandwidth_Bps=1e8))
    inside = predict(spec, Layout(cp=8, tp=1), slow_nic, global_batch=1).breakdown["cp_comm"]  # 8 ≤ 8 per node
    across = predict(spec, Layout(cp=8, tp=2), slow_nic, global_batch=1).breakdown["cp_comm"]  # 16 > 8
    assert across > 10 * inside


# -- the search ---------------------------------------------------------------------------------------------------
def test_search_uses_cp_where_nothing_else_fits():
    spec = llama(131072, layers=2)
    small = dataclasses.replace(H100, memory_bytes=8e9)
    with pytest.raises(NoFeasiblePlan, match="allow .a larger. context parallelism"):
        search(spec, small, devices=8, global_batch=1, pins={"cp": 1, "precision": "bf16-mixed"}, space=Space())
    result = search(spec, small, devices=8, global_batch=1, pins={"precision": "bf16-mixed"}, space=Space())
    assert result.best.plan.cp > 1 and result.best.fits
    assert result.best.plan.devices == 8
    # what shardwise train runs (Space.runnable(), the default) searches cp too
    runnable = search(spec, small, devices=8, global_batch=1, pins={"precision": "bf16-mixed"})
    assert runnable.best.plan.cp > 1 and runnable.best.fits and not runnable.best.plan.sequence_parallel


@pytest.mark.parametrize("seq, devices, batch", [(1024, 8, 32), (2048, 16, 64), (4096, 8, 16)])
def test_search_never_uses_cp_for_short_sequences(seq, devices, batch):
    for spec in (llama(seq), ModelSpec.gpt(n_layer=4, n_embd=768, n_head=12, vocab_size=50304, seq_len=seq)):
        result = search(spec, H100, devices=devices, global_batch=batch, pins={"precision": "bf16-mixed"},
                        space=Space(cp_attention_share=0.0))  # cp searched, whatever the sequence
        assert result.best.plan.cp == 1, [p.plan.describe() for p in result]
        # cp > 1 runs the same tokens per device in smaller attention blocks plus the ring: never faster here
        assert all(p.step_time_s > result.best.step_time_s for p in result if p.plan.cp > 1)


def test_cp_is_searched_only_for_long_sequences_unless_nothing_fits():
    from shardwise.planner.search import _attention_share

    wide = ModelSpec.gpt(n_layer=4, n_embd=4096, n_head=32, vocab_size=50304, seq_len=2048)
    assert _attention_share(wide) < Space().cp_attention_share < _attention_share(llama(32768))
    free = search(wide, H100, devices=16, global_batch=32, pins={"precision": "bf16-mixed"}, space=Space(), top=3)
    forced = search(wide, H100, devices=16, global_batch=32, pins={"precision": "bf16-mixed"},
                    space=Space(cp_attention_share=0.0), top=3)
    assert free.candidates < forced.candidates and all(p.plan.cp == 1 for p in free)
    long = search(llama(32768), H100, devices=8, global_batch=8, pins={"precision": "bf16-mixed"}, space=Space())
    assert any(p.plan.cp > 1 for p in long) or long.candidates > search(
        llama(32768), H100, devices=8, global_batch=8, pins={"precision": "bf16-mixed", "cp": 1}).candidates


def test_search_honours_a_cp_pin():
    result = search(llama(16384), H100, devices=8, global_batch=8, pins={"cp": 2}, top=3)
    assert all(p.plan.cp == 2 and p.plan.devices == 8 for p in result)
    with pytest.raises(ValueError, match="pin cp = 3 must be a positive divisor"):
        search(llama(16384), H100, devices=8, global_batch=8, pins={"cp": 3})
    with pytest.raises(ValueError, match="2·cp = 16"):
        search(llama(1000), H100, devices=8, global_batch=8, pins={"cp": 8})


def test_bounds_hold_for_cp_candidates():
    spec, plan = llama(32768), Layout(cp=2)
    local = local_spec(spec, plan)
    cache: dict = {}
    pool, _ = candidates(local, H100, devices=8, global_batch=8, pins={"cp": 2}, space=Space(max_micro_batch=2),
                         budget=float("inf"), runtime="shardwise", cache=cache)
    assert pool.feasible
    for cand in pool.feasible[::7]:
        assert cand.plan.cp == 2
        pred = predict(local, cand.plan, H100, global_batch=8, cache=cache)
        assert cand.time_lb <= pred.step_time_s * (1 + 1e-12), cand.plan.describe()
        assert cand.memory_lb <= pred.memory.total * (1 + 1e-12), cand.plan.describe()


# -- the published Llama 3 rows -----------------------------------------------------------------------------------
@lru_cache(maxsize=None)
def _llama3(row: Llama3Row) -> float:
    return model_tflops(row, llama3_prediction(row))


@pytest.mark.parametrize("row", [r for r in LLAMA3_TABLE4 if r.cp == 1], ids=lambda r: f"{r.gpus}gpu")
def test_llama3_cp1_rows_within_15_percent(row):
    assert abs(_llama3(row) / row.tflops - 1) <= 0.15, (row, _llama3(row))


def test_llama3_cp16_row_within_30_percent_and_below_the_cp1_rows():
    cp_row = next(r for r in LLAMA3_TABLE4 if r.cp > 1)
    got = _llama3(cp_row)
    assert abs(got / cp_row.tflops - 1) <= 0.30, got
    # the published order: 8K on 8,192 GPUs > 8K on 16,384 > 128K with CP 16
    assert [_llama3(r) for r in LLAMA3_TABLE4] == sorted((_llama3(r) for r in LLAMA3_TABLE4), reverse=True)
    pred = llama3_prediction(cp_row)
    assert pred.plan.cp == 16 and pred.breakdown["cp_comm"] < 0.02 * pred.step_time_s  # the ring hides


# -- the config and the command line ------------------------------------------------------------------------------
def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from shardwise import cli

    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


SMALL = ["--preset", "gpt-small", "--hardware", "h100-80g-sxm"]


def test_parallel_cp_maps_into_the_layout():
    from shardwise.runtime.config import load_config, validate
    from shardwise.runtime.prediction import plan_from_config

    cfg = validate(load_config(preset="gpt-small", overrides={"parallel.nproc": 8, "parallel.cp": 2,
                                                              "parallel.tp": 2}))
    assert (cfg.parallel.dp, cfg.parallel.cp) == (2, 2)
    plan = plan_from_config(cfg)
    assert (plan.dp, plan.cp, plan.tp, plan.devices) == (2, 2, 2, 8)
    with pytest.raises(ValueError, match=r"parallel.dp × parallel.cp × parallel.tp × parallel.pp = 3 × 2 × 1 "):
        validate(load_config(preset="gpt-small", overrides={"parallel.nproc": 8, "parallel.cp": 2, "parallel.dp": 3}))
    with pytest.raises(ValueError, match="parallel.cp"):
        validate(load_config(preset="gpt-small", overrides={"parallel.nproc": 8, "parallel.cp": 0}))


def test_predict_and_plan_take_parallel_cp(capsys):
    rc, out, err = _cli(["predict", *SMALL, "--parallel.nproc", "8", "--parallel.cp", "2", "--json"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert data["plan"]["cp"] == 2 and "cp_comm" in data["breakdown"]
    rc, out, err = _cli(["plan", *SMALL, "--parallel.nproc", "8", "--pin", "parallel.cp=2"], capsys)
    assert rc == 0, err
    assert "cp=2" in out

