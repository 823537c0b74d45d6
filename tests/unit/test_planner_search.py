"""The layout search: its bounds never exceed what ``predict`` says, branch and bound finds what exhaustive
prediction finds, pins hold, bad input is one clear error, and a plan maps to the train config that runs it."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from shardwise.planner import Hardware, ModelSpec, Layout, predict
from shardwise.planner.enumerate import Space, candidates, normalize_pins
from shardwise.planner.pipeline_cost import balance_minmax, flush_lower_bound, simulate_flush
from shardwise.planner.search import NoFeasiblePlan, _rank_key, search
from shardwise.parallel.pipeline.stage import balance_by_params

A100 = Hardware.preset("a100-80g-sxm")


def small_gpt() -> ModelSpec:
    return ModelSpec.gpt(n_layer=8, n_embd=512, n_head=8, vocab_size=4096, seq_len=256, block_size=256)


def _all_candidates(spec, hw, devices, gb, space, runtime="shardwise", pins=None):
    cache: dict = {}
    fixed, _ = normalize_pins(pins or {})
    pool, _ = candidates(spec, hw, devices=devices, global_batch=gb, pins=fixed, space=space,
                         budget=hw.memory_bytes * 0.9, runtime=runtime, cache=cache)
    return pool, cache


def test_flush_lower_bound_never_exceeds_the_simulated_flush():
    rng = random.Random(3)
    for _ in range(200):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"])
        p = rng.choice([2, 3, 4, 8])
        chunks = rng.choice([2, 3]) if schedule == "interleaved" else 1
        m = p * rng.randint(1, 12) if schedule == "interleaved" else rng.randint(1, 40)
        n = p * chunks
        F = [rng.uniform(0.2, 2) for _ in range(n)]
        B = [rng.uniform(0.2, 2) for _ in range(n)]
        W = [rng.uniform(0, 2) for _ in range(n)]
        comm = [rng.uniform(0, 0.5) for _ in range(n - 1)]
        lb = flush_lower_bound(schedule, p, m, chunks, F, B, W, comm)
        assert lb <= simulate_flush(schedule, p, m, chunks, F, B, W, comm).time * (1 + 1e-9)
    # tight where it should be: uniform 1F1B is exactly (m + p - 1)(F + B + W) with free transfers
    assert flush_lower_bound("1f1b", 4, 8, 1, [1] * 4, [2] * 4, [0] * 4, [0] * 3) == pytest.approx((8 + 3) * 3)


def test_balance_minmax_reaches_the_dynamic_programs_optimum():
    rng = random.Random(5)
    for _ in range(200):
        k = rng.randint(1, 30)
        n = rng.randint(1, k)
        w = [rng.randint(1, 100) for _ in range(k)]
        heaviest = lambda st: max(sum(w[a:b]) for a, b in zip(st, st[1:] + [k]))  # noqa: E731
        fast = balance_minmax(w, n)
        assert len(fast) == n and fast[0] == 0 and all(a < b for a, b in zip(fast, fast[1:]))
        assert heaviest(fast) == heaviest(balance_by_params(w, n))


def test_bounds_are_below_the_prediction_of_every_candidate():
    spec = small_gpt()
    pool, cache = _all_candidates(spec, A100, 8, 32, Space(max_micro_batch=4))
    assert pool.total > 200
    sample = random.Random(0).sample(pool.feasible + pool.over_memory, 120)
    for cand in sample:
        pred = predict(spec, cand.plan, A100, global_batch=32, cache=cache)
        assert cand.time_lb <= pred.step_time_s * (1 + 1e-9), cand.plan.describe()
        assert cand.memory_lb <= pred.memory.total * (1 + 1e-9), cand.plan.describe()


@pytest.mark.parametrize("runtime", ["shardwise", "megatron"])
def test_a_groups_bound_is_below_every_candidate_bound_in_it(runtime):
    """The search bounds a whole (tp, pp, dp, recomputation, sp, micro-batch) group before making its plans:
    that bound must never exceed the bound of a plan in the group (else the search could skip the best plan),
    on a GPU preset and on a CPU host whose pipeline ranks share cores. The cheapest bound in a group is close
    to it, or the group bound would prune nothing."""
    from shardwise.planner.groups import LazyPool
    from shardwise.planner.enumerate import Pool

    cpu = dataclasses.replace(A100, host_cores=2, devices_per_node=8)
    for hw in (A100, cpu):
        spec = small_gpt()
        lazy = LazyPool.build(spec, hw, devices=8, global_batch=32, pins={}, space=Space(max_micro_batch=4),
                              budget=math.inf, runtime=runtime, cache={})
        assert len(lazy.groups) > 20
        ratios = []
        for group in lazy.groups:
            lazy.pool = Pool()
            lazy._expand(group)
            bounds = [c.time_lb for c in lazy.pool.feasible]
            assert len(bounds) == group.size
            assert group.time_lb <= min(bounds) * (1 + 1e-9), (group, min(bounds))
            ratios.append(min(bounds) / group.time_lb)
        assert sorted(ratios)[len(ratios) // 2] < 1.5


@pytest.mark.parametrize("hw", [A100, dataclasses.replace(A100, memory_bytes=0.2e9)], ids=["roomy", "tight"])
def test_branch_and_bound_finds_the_exhaustive_best(hw):
    """Predict every candidate; the search's top 3 are the 3 best fitting ones (by the same ranking key)."""
    spec = small_gpt()
    space = Space(max_micro_batch=4)
    pool, cache = _all_candidates(spec, hw, 8, 32, space)
    preds = [predict(spec, c.plan, hw, global_batch=32, cache=cache) for c in pool.feasible + pool.over_memory]
    fitting = sorted((p for p in preds if p.memory.total <= hw.memory_bytes * 0.9), key=_rank_key)
    assert fitting, "the tight budget must leave some plan"
    result = search(spec, hw, devices=8, global_batch=32, top=3, space=space)
    assert [_rank_key(p) for p in result] == pytest.approx([_rank_key(p) for p in fitting[:3]])
    assert result.evaluated < len(preds)  # it did prune
    if hw.memory_bytes < 1e9:  # the tight budget rules out plain data parallelism
        plain = [p for p in preds if p.plan.pp == 1 and p.plan.tp == 1 and p.plan.zero_stage == 0]
        assert all(p.memory.total > hw.memory_bytes * 0.9 for p in plain)


def test_pins_are_honoured_and_module_pins_replicate_the_embedding():
    spec = small_gpt()
    result = search(spec, A100, devices=8, global_batch=32, pins={"tp": 2, "pp_schedule": "1f1b", "pp": 2}, top=5)
    assert all(p.plan.tp == 2 and p.plan.pp == 2 and p.plan.schedule == "1f1b" for p in result)
    pinned = search(spec, A100, devices=8, global_batch=32, pins={"tp": 4, "pp": 1, "modules": {"wte": "replicate"}},
                    top=1)[0]
    free = predict(spec, pinned.plan, A100, global_batch=32)
    # the replicated embedding (and its tied head) hold all their parameters on every tp rank
    assert pinned.memory.params > free.memory.params
    vocab_params = 4096 * 512  # fp32 bytes: 4 per element; ZeRO-3 divides what each rank keeps by dp
    shard = pinned.plan.dp if pinned.plan.zero_stage == 3 else 1
    assert pinned.memory.params - free.memory.params == pytest.approx(4 * vocab_params * (1 - 1 / 4) / shard,
                                                                      rel=0.01)


def test_a_pinned_schedule_asks_for_a_pipeline():
    # zb-h1 (or interleaved chunks, a micro-batch count) means nothing on one stage: pp is free, so only
    # pipelines are returned; the default schedule 1f1b still lets the search return pp = 1
    piped = search(small_gpt(), A100, devices=8, global_batch=32, pins={"pp_schedule": "zb-h1"}, top=3)
    assert all(p.plan.pp >= 2 and p.plan.schedule == "zb-h1" for p in piped)
    chunked = search(small_gpt(), A100, devices=8, global_batch=32, pins={"pp_chunks": 2}, top=3)
    assert all(p.plan.pp >= 2 and p.plan.chunks == 2 and p.plan.schedule == "interleaved" for p in chunked)
    free = search(small_gpt(), A100, devices=8, global_batch=32, pins={"pp_schedule": "1f1b"}, top=1)
    unpinned = search(small_gpt(), A100, devices=8, global_batch=32, top=1)
    assert free[0].plan.pp == unpinned[0].plan.pp


def test_time_balanced_split_beats_the_parameter_split():
    spec = small_gpt()
    plan = search(spec, A100, devices=4, global_batch=32, pins={"pp": 4, "tp": 1, "pp_schedule": "1f1b"}, top=1)[0].plan
    assert plan.pp_split  # the search always states its cut
    by_time = predict(spec, plan, A100, global_batch=32)
    by_params = predict(spec, dataclasses.replace(plan, pp_split=()), A100, global_batch=32)
    assert by_time.step_time_s <= by_params.step_time_s


@pytest.mark.parametrize("kwargs, match", [
    (dict(devices=0), "at least one device"),
    (dict(pins={"tp": 3}), "divisor of the 8 devices"),
    (dict(pins={"dp": 4, "tp": 4, "pp": 2}), "must equal the device count"),
    (dict(pins={"pp_schedule": "interleaved", "pp_chunks": 1}), "contradict"),
    (dict(pins={"zero_stage": 2, "dp": 1}), "contradict"),
    (dict(pins={"pp_schedule": "zb-h1", "pp": 1}), r"pins pp 1 and schedule 'zb-h1' contradict: .*pp >= 2"),
    (dict(pins={"pp_microbatches": 4, "pp": 1}), r"pins pp 1 and microbatches 4 contradict"),
    (dict(pins={"pp_schedule": "gpipe"}, devices=1), r"invalid: the pins need a pipeline .*pp=1 vs pinned "
                                                     r"schedule 'gpipe'"),
    (dict(pins={"warp": 2}), "not a plan field"),
    (dict(pins={"modules": {"nope": "replicate"}}), "not a layer"),
    (dict(memory_margin=1.5), "memory_margin"),
])
def test_bad_input_is_one_clear_error(kwargs, match):
    args = dict(devices=8, global_batch=32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        search(small_gpt(), A100, **args)


def test_a_model_that_fits_nowhere_names_the_closest_plan():
    tiny = dataclasses.replace(A100, memory_bytes=1e6)
    with pytest.raises(NoFeasiblePlan, match=r"fits no layout .* needs .* MiB per device") as info:
        search(small_gpt(), tiny, devices=8, global_batch=32)
    closest = info.value.closest
    assert closest is not None and not closest.fits
    # nothing else searched needs less memory than the closest plan the error names
    pool, cache = _all_candidates(small_gpt(), tiny, 8, 32, Space.runnable())
    assert min(c.memory_lb for c in pool.over_memory) <= closest.memory.total


def test_search_times_are_recorded_and_results_serialise():
    result = search(small_gpt(), A100, devices=64, global_batch=128, top=2)
    data = result.to_json()
    assert data["search_s"] > 0 and len(data["plans"]) == 2
    assert Layout.from_json(data["plans"][0]["plan"]) == result[0].plan
    assert {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "fits", "memory", "breakdown"} <= set(
        data["plans"][0]["prediction"])


def test_fast_simulation_equals_the_pipeline_simulator():
    """The planner's tuple-based simulation gives the project's simulator's makespan, busy time and peaks."""
    from shardwise.parallel.pipeline.schedules import get_schedule
    from shardwise.parallel.pipeline.simulate import Costs, simulate
    from shardwise.planner.pipeline_cost import fast_simulate

    rng = random.Random(11)
    for _ in range(60):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"])
        p = rng.choice([2, 3, 4])
        chunks = rng.choice([2, 3]) if schedule == "interleaved" else 1
        m = p * rng.randint(1, 4) if schedule == "interleaved" else rng.randint(1, 12)
        n = p * chunks
        F, B, W = ([rng.uniform(0.1, 2) for _ in range(n)] for _ in range(3))
        comm = [rng.uniform(0, 0.4) for _ in range(n - 1)]
        sched = get_schedule(schedule, p=p, m=m, chunks=chunks)
        ref = simulate(sched, Costs(F=tuple(F), B=tuple(B), W=tuple(W), comm=tuple(comm)))
        makespan, busy, peaks = fast_simulate(sched, F, B, W, comm)
        assert makespan == pytest.approx(ref.makespan)
        assert busy == pytest.approx(ref.busy)
        assert peaks == ref.peak_in_flight


def test_on_a_cpu_host_communication_does_not_hide_under_compute():
    """gloo progresses on the cores the ranks compute on: with host_cores set, the data-parallel reduction and
    ZeRO-3's per-unit gathers are fully exposed, and each ZeRO-3 unit collective waits for the slowest rank."""
    spec = small_gpt()
    gpu = dataclasses.replace(A100, sync_skew_s=1e-3)
    cpu = dataclasses.replace(gpu, host_cores=64)  # more cores than ranks: only the overlap rule differs
    plain = Layout(dp=8, micro_batch=1)
    assert (predict(spec, plain, cpu, global_batch=32).breakdown["dp_comm"]
            > predict(spec, plain, gpu, global_batch=32).breakdown["dp_comm"])
    z3 = Layout(dp=8, zero_stage=3, micro_batch=1)
    got = predict(spec, z3, cpu, global_batch=32)
    units = len(spec.layers)
    assert got.plan.grad_accum == 4
    # at least the waits: 3 collectives per unit per pass, each behind the slowest replica
    assert got.breakdown["dp_comm"] >= got.plan.grad_accum * 3 * units * 1e-3


def test_search_on_a_megatron_row_is_at_least_as_fast_as_the_papers_layout():
    """``benchmarks/planner_published.py --search`` on the smallest Table 1 row (both spaces), and its table."""
    from benchmarks.planner.search_published import published_search_lines, search_row
    from benchmarks.planner.published import MEGATRON_TABLE1

    row = search_row(MEGATRON_TABLE1[0], A100)
    for space in ("free", "megatron-2021"):
        assert row[space]["at_least_as_fast"]
        assert row[space]["predicted_tflops"] >= row["paper_predicted_tflops"]
        plan = Layout.from_json(row[space]["plan"])
        assert plan.devices == 32 and plan.precision == "bf16-mixed"
    assert Layout.from_json(row["megatron-2021"]["plan"]).zero_stage == 0
    lines = published_search_lines([row], [{"devices": 32, "search_s": 0.1, "cpu_s": 0.1, "candidates": 10,
                                            "evaluated": 2, "best": "x", "best_tflops": 1.0}])
    assert any(row["paper_layout"] in line for line in lines)
    assert any("every row: yes" in line for line in lines)


def test_search_speed_rows_are_cold_and_repeatable():
    """``benchmarks/planner_published.py --search`` times each size cold (schedule caches emptied) and reports the
    median of its runs; a cold search returns what a warm one does."""
    from benchmarks.planner.search_published import search_speed

    (row,) = search_speed(A100, sizes=(64,), repeats=2)
    assert len(row["cpu_s_runs"]) == 2 and row["cpu_s"] > 0 and row["evaluated"] >= 1
    assert row["candidates"] > 100 and row["best"].startswith("dp=")
    (again,) = search_speed(A100, sizes=(64,), repeats=1)
    assert again["best"] == row["best"] and again["evaluated"] == row["evaluated"]


def test_a_groups_bound_does_not_depend_on_which_groups_were_bounded_before():
    """Group bounds share a cache: the bound of a pp-4 group is the same whether or not pp 1 and 2 were bounded
    first, and its pipeline fill makes it larger than the whole-model work over pp alone."""
    from shardwise.planner.groups import LazyPool

    spec = small_gpt()
    kw = dict(devices=8, global_batch=32, space=Space(max_micro_batch=4), budget=math.inf, runtime="shardwise")
    alone = LazyPool.build(spec, A100, pins={"pp": 4}, cache={}, **kw)
    every = LazyPool.build(spec, A100, pins={}, cache={}, **kw)
    key = lambda g: (g.tp, g.pp, g.dp, g.mb, g.ckpt, g.sp)  # noqa: E731
    bounds = {key(g): g.time_lb for g in every.groups}
    assert alone.groups and all(bounds[key(g)] == pytest.approx(g.time_lb, rel=1e-12) for g in alone.groups)
    # the same groups on a host whose 2 cores the 8 ranks share: there the bound leaves the fill out
    shared = {key(g): g.time_lb for g in LazyPool.build(spec, dataclasses.replace(A100, host_cores=2), pins={},
                                                          cache={}, **kw).groups}
    deep = [g for g in every.groups if g.pp == 4]
    assert deep and all(g.time_lb > shared[key(g)] for g in deep)
