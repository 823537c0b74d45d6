"""The search's pruning changes its speed, never its answer: the top plans of small searches equal a brute-force
ranking of every plan in the same space by ``predict`` (no bounds, no groups, no early stops), and the closed
forms the pruning relies on equal what the pipeline simulation counts."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from shardwise.parallel.pipeline.schedules import get_schedule
from shardwise.planner import Hardware, ModelSpec, Layout, predict
from shardwise.planner.enumerate import Space, _schedule_options, _split, layouts, normalize_pins, variants
from shardwise.planner.pipeline_cost import first_rank_in_flight, simulate_flush
from shardwise.planner.predict import _hardware_for, layer_costs
from shardwise.planner.search import _rank_key, search

A100 = Hardware.preset("a100-80g-sxm")


def _peaks_by_walking(name: str, p: int, m: int, chunks: int) -> tuple[int, ...]:
    """Each rank's peak activation sets, counted by walking the generated schedule: a forward takes one, the
    action that frees it (W when backward is split, else B) gives it back. Independent of the planner."""
    sched = get_schedule(name, p=p, m=m, chunks=chunks)
    freeing = "W" if sched.split_backward else "B"
    out = []
    for acts in sched.ranks:
        held = peak = 0
        for a in acts:
            if not a.is_compute:
                continue
            held += a.kind == "F"
            held -= a.kind == freeing
            peak = max(peak, held)
        out.append(peak)
    return tuple(out)


def test_first_rank_in_flight_is_what_the_flush_simulation_holds_on_rank_0():
    """The memory bound counts rank 0's peak in closed form; it must equal the simulated flush's count (which
    for long flushes is taken on a capped one), and rank 0 must be the rank that holds the most."""
    rng = random.Random(7)
    checked = 0
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"):
        for p in range(2, 10):
            for chunks in ((2, 3, 4) if name == "interleaved" else (1,)):
                for m in range(1, 5 * p + 2):
                    if name == "interleaved" and m % p:
                        continue
                    n = p * chunks
                    F, B, W = ([rng.uniform(0.2, 2) for _ in range(n)] for _ in range(3))
                    flush = simulate_flush(name, p, m, chunks, F, B, W, [rng.uniform(0, 0.3)] * (n - 1))
                    got = first_rank_in_flight(name, p, m, chunks)
                    assert got == flush.in_flight[0] == max(flush.in_flight), (name, p, m, chunks)
                    if m <= 4 * p and name != "gpipe":  # uncapped: also what the schedule itself holds
                        assert got == _peaks_by_walking(name, p, m, chunks)[0], (name, p, m, chunks)
                    checked += 1
    assert checked > 500
    assert first_rank_in_flight("1f1b", 1, 8, 1) == 1
    # Megatron's interleaved warm-up on rank 0: 2(p-1) + (chunks-1)p forwards, then one more
    assert first_rank_in_flight("interleaved", 4, 16, 2) == 2 * 3 + 4 + 1


# -- the search's answer equals brute force ---------------------------------------------------------------------
def small_gpt(n_layer: int = 8) -> ModelSpec:
    return ModelSpec.gpt(n_layer=n_layer, n_embd=512, n_head=8, vocab_size=4096, seq_len=256, block_size=256)


def _every_plan(spec: ModelSpec, hw: Hardware, devices: int, gb: int, space: Space, pins: dict) -> list[Layout]:
    """Every plan of the space, from its definition alone (layouts × variants × micro-batches × schedule options
    × ZeRO stages, each pipeline cut by the time-balanced split): no bound, no group, no early stop."""
    cache: dict = {}
    hw_d = _hardware_for(hw, devices, cache)
    precision = pins.get("precision", space.precision)
    out = []
    for tp, pp, dp in layouts(spec, hw, devices=devices, global_batch=gb, pins=pins, regions={}):
        per = gb // dp
        for ckpt, sp, mbs, zeros in variants(spec, tp=tp, pp=pp, dp=dp, per=per, pins=pins, space=space):
            for mb in mbs:
                base = Layout(dp=dp, tp=tp, pp=pp, micro_batch=mb, activation_checkpointing=ckpt, sequence_parallel=sp,
                            precision=precision)
                per_layer = layer_costs(spec, base, hw_d, cache)
                for schedule, chunks, accum in _schedule_options(pp, per, mb, space, pins, len(spec.layers), ckpt):
                    split = _split(spec, per_layer, pp * chunks, space, pins, cache, key=(tp, mb, ckpt, sp))
                    out += [dataclasses.replace(base, zero_stage=z, grad_accum=accum, schedule=schedule,
                                                chunks=chunks, pp_split=split,
                                                microbatches=per // mb // accum if pp > 1 else 0) for z in zeros]
    return out


def _memory(gb: float, **kw) -> Hardware:
    return dataclasses.replace(A100, memory_bytes=gb * 1e9, **kw)


CASES = {
    # name: (hardware, devices, global batch, space, runtime, pins, top); the budgets leave half the plans out
    "roomy": (A100, 8, 32, Space(max_micro_batch=4), "shardwise", {}, 5),
    "tight": (_memory(0.2), 8, 32, Space(max_micro_batch=4), "shardwise", {}, 5),
    "megatron-bf16": (_memory(0.12), 16, 64, Space(precision="bf16-mixed", max_micro_batch=4), "megatron", {}, 8),
    "cpu-host": (_memory(0.2, host_cores=2, devices_per_node=8), 8, 32, Space(max_micro_batch=2), "shardwise",
                 {"precision": "fp32"}, 3),
    "pinned-pp": (_memory(0.15), 16, 64, Space(max_micro_batch=2), "megatron", {"pp": 4}, 4),
}


@pytest.mark.parametrize("name", list(CASES))
def test_search_returns_the_brute_force_top_plans_bit_for_bit(name):
    """Predict every plan of the space (``predict``, a cache of its own) and rank the ones that fit by the
    search's ranking key: the search's top K are those plans with identical predictions, in that order (plans
    whose keys tie exactly may come in either order). The cases make every pruning rule bite: memory bounds
    (tight budgets; interleaved plans holding many micro-batches), group bounds, a CPU host whose ranks share
    cores, pins."""
    hw, devices, gb, space, runtime, pins, top = CASES[name]
    spec = small_gpt()
    budget = hw.memory_bytes * 0.9
    fixed, _ = normalize_pins(pins)
    cache: dict = {}
    preds = [predict(spec, p, hw, global_batch=gb, runtime=runtime, cache=cache)
             for p in _every_plan(spec, hw, devices, gb, space, fixed)]
    fitting = sorted((p for p in preds if p.memory.total <= budget), key=_rank_key)
    assert len(fitting) > top
    assert name == "roomy" or len(fitting) < 0.75 * len(preds), "the case must leave plans out by memory"
    result = search(spec, hw, devices=devices, global_batch=gb, pins=pins, space=space, runtime=runtime, top=top)
    assert result.evaluated < len(preds) / 4, "the search must prune"
    assert [_rank_key(p) for p in result] == [_rank_key(p) for p in fitting[:top]]
    got = {p.plan: p.to_json() for p in result}
    want = {p.plan: p.to_json() for p in fitting[:top]}
    ties = _rank_key(fitting[top - 1]) == _rank_key(fitting[top])  # a tie at the cut: either plan may be kept
    assert ties or got == want
    assert [p.plan for p in result if list(got).count(p.plan) > 1] == []
    for pred in result:  # bit for bit: the search's prediction is predict's own
        assert pred.to_json() == predict(spec, pred.plan, hw, global_batch=gb, runtime=runtime).to_json()


def test_a_groups_least_bound_is_its_best_fitting_candidates_bound():
    """``group_least`` (computed without making candidates) equals, bit for bit, the least time bound of the
    group's candidates within the budget, their count and the least memory floor of all of them."""
    from shardwise.planner.enumerate import Pool
    from shardwise.planner.group_bounds import group_least
    from shardwise.planner.groups import LazyPool

    hw, _, _, space, _, _, _ = CASES["megatron-bf16"]
    budget = hw.memory_bytes * 0.9
    lazy = LazyPool.build(small_gpt(), hw, devices=16, global_batch=64, pins={}, space=space, budget=budget,
                          runtime="megatron", cache={})
    counted = {"some fit": 0, "none fit": 0}
    for group in lazy.groups:
        lazy.pool = Pool()
        lazy._expand(group)
        bound, least, fit = group_least(lazy.spec, lazy.hw, group, {}, space, budget, "megatron", lazy.cache, {})
        fitting = [c.time_lb for c in lazy.pool.feasible]
        assert fit == len(fitting) and least == min(c.memory_floor for c in lazy.pool.feasible
                                                    + lazy.pool.over_memory)
        assert bound == (min(fitting) if fitting else math.inf)
        counted["some fit" if fitting else "none fit"] += 1
    assert all(counted.values()), counted


def test_the_search_leaves_the_garbage_collector_as_it_found_it():
    """The search pauses Python's cyclic collector while it runs; it must come back on (or stay off), also when
    the search raises."""
    import gc

    assert gc.isenabled()
    search(small_gpt(), A100, devices=8, global_batch=32, top=1)
    assert gc.isenabled()
    with pytest.raises(ValueError):
        search(small_gpt(), A100, devices=8, global_batch=32, pins={"tp": 3})
    assert gc.isenabled()
    gc.disable()
    try:
        search(small_gpt(), A100, devices=8, global_batch=32, top=1)
        assert not gc.isenabled()
    finally:
        gc.enable()
