"""The flush on ranks that share a host's cores (``planner.shared_cores``): processor sharing, action by action."""

from __future__ import annotations

import dataclasses
import random

import pytest

from shardwise.planner import Hardware, ModelSpec, Plan, predict
from shardwise.planner.flush_sim import fast_simulate
from shardwise.planner.pipeline_cost import _schedule
from shardwise.planner.shared_cores import shared_makespan

CASES = [("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1), ("zb-h1", 4, 8, 1), ("zb-h2", 3, 6, 1), ("interleaved", 2, 4, 2)]


def _costs(rng: random.Random, stages: int) -> tuple[list[float], ...]:
    F = [rng.uniform(0.5, 1.5) for _ in range(stages)]
    B = [rng.uniform(0.5, 2.0) for _ in range(stages)]
    W = [rng.uniform(0.1, 0.8) for _ in range(stages)]
    comm = [rng.uniform(0.0, 0.2) for _ in range(stages - 1)]
    return F, B, W, comm


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_enough_cores_is_the_dedicated_flush(name, p, m, v):
    # as many cores as busy ranks: nobody shares, so the event simulation must reproduce flush_sim exactly
    rng = random.Random(p * 31 + m)
    F, B, W, comm = _costs(rng, p * v)
    sched = _schedule(name, p, m, v)
    want = fast_simulate(sched, F, B, W, comm)[0]
    assert shared_makespan(sched, F, B, W, comm, cores=64, copies=2, calibrated=8) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_sharing_lies_between_total_work_and_the_dedicated_flush(name, p, m, v):
    rng = random.Random(p * 7 + m)
    F, B, W, comm = _costs(rng, p * v)
    sched = _schedule(name, p, m, v)
    dedicated = fast_simulate(sched, F, B, W, comm)[0]
    shared = shared_makespan(sched, F, B, W, comm, cores=2, copies=1, calibrated=p)
    # calibrated with p ranks on 2 cores: each calibrated second is 2/p core-seconds; 2 cores do them no faster
    work = m * (sum(F) + sum(B) + sum(W)) * 2 / p
    assert work / 2 - 1e-9 <= shared < dedicated


def test_two_stages_on_one_core_by_hand():
    # GPipe, p = 2, m = 2, F = B = 1 calibrated with both ranks busy on one core (half a core each), transfer 0.5.
    # Alone a rank runs twice as fast: r0 F F 0 - 1.0; r1 F(0) from 1.0 (0.5 + transfer) to 1.5, F(1) 1.5 - 2.0,
    # its two B 2.0 - 3.0; r0's B wait for r1's B + transfer: 3.0 - 3.5 and 3.5 - 4.0. Never both busy at once.
    sched = _schedule("gpipe", 2, 2, 1)
    got = shared_makespan(sched, [1.0, 1.0], [1.0, 1.0], [0.0, 0.0], [0.5], cores=1, copies=1, calibrated=2)
    assert got == pytest.approx(4.0)
    # and one micro-batch without transfers: F, F, B, B at double speed = (1 + 1 + 2 + 2) / 2
    sched = _schedule("gpipe", 2, 1, 1)
    assert shared_makespan(sched, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0], cores=1, copies=1,
                           calibrated=2) == pytest.approx(3.0)


def test_copies_share_the_same_cores():
    # two replicas of a 2-stage pipeline on 2 cores, calibrated with 4 busy: with both stages busy the four ranks
    # run at the calibrated speed; a rank alone (with its replica) runs at 2 / 2 = 1 core, twice the calibrated
    sched = _schedule("gpipe", 2, 1, 1)
    got = shared_makespan(sched, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0], cores=2, copies=2, calibrated=4)
    assert got == pytest.approx(3.0)
    one_replica = shared_makespan(sched, [1.0, 1.0], [2.0, 2.0], [0.0, 0.0], [0.0], cores=2, copies=1, calibrated=4)
    assert one_replica == pytest.approx(3.0)  # one rank alone still runs on one core at most


def test_predict_uses_core_sharing_for_pipelines_on_a_cpu_host():
    spec = ModelSpec.gpt(n_layer=4, n_embd=64, n_head=4, vocab_size=128, seq_len=64, block_size=64)
    gpu = Hardware.preset("a100-80g-sxm")
    cpu = dataclasses.replace(gpu, host_cores=2, devices_per_node=4, calibrated_ranks=4)
    dedicated = dataclasses.replace(cpu, host_cores=0, calibrated_ranks=0)
    plan = Plan(pp=4, micro_batch=1, schedule="1f1b", precision="fp32").resolved(8)
    shared, alone = predict(spec, plan, cpu, global_batch=8), predict(spec, plan, dedicated, global_batch=8)
    # same compute per action; in the warm-up and drain the busy ranks take the idle ones' cores
    assert shared.breakdown["pipeline_bubble"] < alone.breakdown["pipeline_bubble"]
    assert shared.step_time_s < alone.step_time_s
