"""Simulator: closed-form bubbles and memory of each schedule, timelines that honour dependencies, deadlocks.

Every expected number below is a closed form from the papers (or a hand derivation written next to it),
never a value produced by the code under test.
"""

from __future__ import annotations

import threading

import pytest

from shardwise.parallel.pipeline.actions import Action, Schedule, parse_schedule
from shardwise.parallel.pipeline.communication import lower_communication
from shardwise.parallel.pipeline.schedules import get_schedule
from shardwise.parallel.pipeline.simulate import Costs, ScheduleDeadlock, dependencies, simulate

PS = (1, 2, 3, 4, 8)
MS = (1, 2, 3, 5, 8, 12)
EQUAL_COSTS = (Costs(F=1, B=1, W=1), Costs(F=1, B=2, W=1.5), Costs(F=0.5, B=1, W=0))


@pytest.mark.parametrize("costs", EQUAL_COSTS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_closed_form(name, costs):
    # GPipe paper: bubble fraction (p-1)/(m+p-1) for equal stage costs; 1F1B has the same bubble.
    for p in PS:
        for m in MS:
            res = simulate(get_schedule(name, p=p, m=m), costs)
            assert res.bubble_ratio == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)
            per_mb = costs.F + costs.B + costs.W
            assert res.makespan == pytest.approx((m + p - 1) * per_mb)


def test_activations_in_flight_gpipe_vs_1f1b():
    for p in PS:
        for m in MS:
            gp = simulate(get_schedule("gpipe", p=p, m=m))
            one = simulate(get_schedule("1f1b", p=p, m=m))
            assert gp.peak_in_flight == (m,) * p
            # 1F1B: rank r holds at most p - r micro-batches (its warm-up p-r-1 plus one)
            assert one.peak_in_flight == tuple(min(p - r, m) for r in range(p))


@pytest.mark.parametrize("p", (2, 3, 4, 8))
def test_zb_h1_bubble_a_third_of_1f1b_at_equal_costs(p):
    # ZB paper: 1F1B idles (p-1)(F+B+W) per rank, ZB-H1 (p-1)(F+B-W): a third when F = B = W, once
    # m >= p (the steady state exists). The bubble *ratio* also divides by the step time, which is shorter
    # for ZB-H1: ratio_zb / ratio_1f1b = (m+p-1) / (3m+p-1) -> 1/3 as m grows; at m = 8p it is within
    # 0.04 of 1/3 for every p here ((8p+p-1)/(24p+p-1) - 1/3 = (2p-2)/(3(25p-1)) < 2/75).
    for m in (p, 2 * p, 3 * p + 1, 8 * p):
        zb = simulate(get_schedule("zb-h1", p=p, m=m))
        one = simulate(get_schedule("1f1b", p=p, m=m))
        assert zb.idle == pytest.approx([(p - 1) * 1.0] * p)
        assert one.idle == pytest.approx([(p - 1) * 3.0] * p)
        assert zb.bubble_ratio / one.bubble_ratio == pytest.approx((m + p - 1) / (3 * m + p - 1))
        # same peak memory as 1F1B: no rank holds more than p micro-batches (1F1B's rank 0)
        assert max(zb.peak_in_flight) == max(one.peak_in_flight) == p
    m = 8 * p
    zb, one = simulate(get_schedule("zb-h1", p=p, m=m)), simulate(get_schedule("1f1b", p=p, m=m))
    ratio = zb.bubble_ratio / one.bubble_ratio
    assert abs(ratio - 1 / 3) < 0.04


@pytest.mark.parametrize("F,B,W", [(2, 2, 1), (1, 2, 1), (1, 1, 0.5), (2, 1, 1)])
def test_zb_h1_bubble_unequal_costs(F, B, W):
    # (p-1)(F+B-W), the paper's ZB-H1 bubble, for W <= F (W fits in the gap a forward would leave)
    for p in (2, 3, 4):
        for m in (p, 3 * p + 1):
            zb = simulate(get_schedule("zb-h1", p=p, m=m), Costs(F=F, B=B, W=W))
            assert zb.idle == pytest.approx([(p - 1) * (F + B - W)] * p)


def _span(res, rank):
    mine = [e for e in res.timeline if e.rank == rank]
    return mine[0].start, mine[-1].end


@pytest.mark.parametrize("p", (1, 2, 3, 4, 8))
def test_zb_h2_parallelogram_at_equal_costs(p):
    # Hand derivation (unit slots, F = B = W = 1, comm 0), see ``zb_h2``: F_0 reaches rank r at r; B_0 comes
    # back to rank r at 2p-1-r, exactly when its 2(p-r)-1 warm-up forwards end; then B_j W_j F (3 slots per
    # micro-batch) and a tail with a B every 2 slots keep every rank busy without a gap: rank r runs from r
    # to r + 3m. So the step takes 3m + p-1 and every rank idles p-1 (r before its start, p-1-r after its
    # end) -- the least possible: rank p-1 cannot start before p-1 and has 3m of work.
    for m in (2 * p - 1, 2 * p, 3 * p + 1, 8 * p):
        zb2 = simulate(get_schedule("zb-h2", p=p, m=m))
        assert zb2.makespan == 3 * m + p - 1
        assert [_span(zb2, r) for r in range(p)] == [(r, r + 3 * m) for r in range(p)]
        assert zb2.idle == pytest.approx([p - 1] * p)
        # ZB-H1 has the same total, but rank r waits p-1-r for its first B *inside* its span (it ran only
        # p-r warm-up forwards), so its ranks all end together at 3m + p-1 (a trapezoid)
        zb1 = simulate(get_schedule("zb-h1", p=p, m=m))
        assert [_span(zb1, r) for r in range(p)] == [(r, 3 * m + p - 1) for r in range(p)]
        assert zb2.bubble_ratio == pytest.approx(zb1.bubble_ratio) == pytest.approx((p - 1) / (3 * m + p - 1))


def _back_to_back(s: Schedule, steps: int) -> Schedule:
    # ``steps`` copies of each rank's list, copy c on micro-batches c*m .. c*m + m-1: consecutive steps with no
    # barrier between them (the zero-bubble paper's optimizer post-validation), as one schedule.
    ranks = tuple(tuple(Action(a.stage, a.kind, c * s.m + a.microbatch) for c in range(steps) for a in acts)
                  for acts in s.ranks)
    return Schedule(name=f"{s.name}x{steps}", p=s.p, m=s.m * steps, chunks=1, split_backward=True, ranks=ranks)


@pytest.mark.parametrize("p", (2, 3, 4, 8))
def test_zb_h2_steps_interlock_to_zero_bubble(p):
    # The parallelogram tiles: step c runs on rank r from r + 3mc to r + 3m(c+1), so k steps take 3km + p-1
    # and the bubble ratio (p-1)/(3km+p-1) tends to 0. ZB-H1's rank 0 waits p-1 for its first B in every
    # step, and all its ranks end each step together, so k steps take k(3m + p-1): its ratio stays
    # (p-1)/(3m+p-1), the single-step figure.
    for m in (2 * p - 1, 2 * p + 3):
        for k in (2, 4):
            zb2 = simulate(_back_to_back(get_schedule("zb-h2", p=p, m=m), k))
            zb1 = simulate(_back_to_back(get_schedule("zb-h1", p=p, m=m), k))
            assert zb2.makespan == 3 * k * m + p - 1
            assert zb1.makespan == k * (3 * m + p - 1)
            assert zb2.bubble_ratio == pytest.approx((p - 1) / (3 * k * m + p - 1))
            assert zb1.bubble_ratio == pytest.approx((p - 1) / (3 * m + p - 1))
            # their ratio (3m+p-1)/(3km+p-1) is below 1/(k-1) whenever (k-2)(p-1) < 3m, as here (m >= 2p-1)
            assert zb2.bubble_ratio < zb1.bubble_ratio / (k - 1)


@pytest.mark.parametrize("p", (1, 2, 3, 4, 5, 8))
def test_zb_h2_small_m_and_memory(p):
    # Every m (the generator's fallback covers m < 2p-1): at F = B = W = 1 no schedule can beat
    # max(3m + p-1, 2m + 2p-1) -- rank p-1 starts at p-1 with 3m of work; rank 0 cannot get B_0 before
    # 2p-1 (F_0 down p ranks, B_0 back up p-1) and then still has m B's and m W's to run. ZB-H2 meets it.
    for m in range(1, 3 * p + 2):
        res = simulate(get_schedule("zb-h2", p=p, m=m))
        assert res.makespan == max(3 * m + p - 1, 2 * m + 2 * p - 1), (p, m)
        # memory: rank 0 holds its warm-up, min(2p-1, m), and keeps it through B W F; rank r > 0 gets back
        # to 2p-1 = (2p-1-2r) + 2r at the end of its tail (2r forwards whose W's wait). Paper: <= 2p-1.
        assert res.peak_in_flight == tuple(min(2 * p - 1, m) for _ in range(p)), (p, m)


@pytest.mark.parametrize("F,B,W,comm", [(1, 2, 1, 0), (1, 1, 0.5, 0), (2, 3, 2, 0), (1, 1, 1, 0.25), (1, 1, 1, 1)])
def test_zb_h2_reaches_the_one_step_lower_bound(F, B, W, comm):
    # No schedule can do better in one step than (p-1)(F+comm) + m(F+B+W): the last rank's first input
    # arrives after p-1 forwards and transfers, and every rank has m(F+B+W) of work. With m >= 2p-1 (and
    # here B <= 2F, B <= 2W) ZB-H2 meets it; ZB-H1 idles (p-1)(F+B-W) at comm 0, more whenever B > W.
    for p in (2, 3, 4, 8):
        for m in (2 * p - 1, 3 * p + 1):
            costs = Costs(F=F, B=B, W=W, comm=comm)
            zb2 = simulate(get_schedule("zb-h2", p=p, m=m), costs)
            assert zb2.idle == pytest.approx([(p - 1) * (F + comm)] * p), (p, m)
            zb1 = simulate(get_schedule("zb-h1", p=p, m=m), costs)
            if comm == 0:
                assert zb1.idle == pytest.approx([(p - 1) * (F + B - W)] * p)
            if B > W or comm > 0:
                assert zb1.makespan > zb2.makespan


@pytest.mark.parametrize("chunks", (2, 3, 4))
def test_interleaved_divides_the_bubble_by_chunks(chunks):
    # Megatron-LM (Narayanan et al. 2021): with v chunks per rank the bubble time is (p-1)(F+B)/v, F and B
    # being a rank's full-model costs (each chunk costs F/v). The busy time m(F+B) is unchanged.
    full = Costs(F=1, B=1, W=1)
    for p in (2, 3, 4, 8):
        for m in (p, 2 * p, 3 * p):
            inter = simulate(get_schedule("interleaved", p=p, m=m, chunks=chunks), full.per_chunk(chunks))
            one = simulate(get_schedule("1f1b", p=p, m=m), full)
            assert inter.idle == pytest.approx([(p - 1) * 3.0 / chunks] * p)
            assert inter.makespan == pytest.approx(3.0 * m + (p - 1) * 3.0 / chunks)
            assert inter.bubble_ratio < one.bubble_ratio


def test_communication_time_on_every_boundary():
    # GPipe, hand derivation: rank p-1 ends its forwards at mF + (p-1)(F+c); backwards drain there in
    # m*Bf, then the last gradient climbs p-1 boundaries: + (p-1)(Bf + c). Bf = B + W (full backward).
    F, B, W, c = 1.0, 1.5, 0.5, 0.25
    for p in (2, 3, 4):
        for m in (1, 4, 7):
            res = simulate(get_schedule("gpipe", p=p, m=m), Costs(F=F, B=B, W=W, comm=c))
            assert res.makespan == pytest.approx(m * (F + B + W) + (p - 1) * (F + B + W + 2 * c))


def test_per_stage_costs_slowest_stage_paces_gpipe():
    # p=2, F=(1,3), B=W=1 (full backward 2). Rank 1's forwards run back to back from t=1 (paced by its
    # F=3): end 1+3m; its backwards end 1+5m; rank 0's last backward waits for that: 1+5m+2.
    for m in (1, 3, 6):
        res = simulate(get_schedule("gpipe", p=2, m=m), Costs(F=(1, 3), B=1, W=1))
        assert res.makespan == pytest.approx(5 * m + 3)
        assert res.busy == pytest.approx((3 * m, 5 * m))


@pytest.mark.parametrize("name,chunks", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("zb-h2", 1), ("interleaved", 2)])
def test_timeline_honours_dependencies(name, chunks):
    costs = Costs(F=(1, 2, 1, 3) * chunks, B=(2, 1, 1, 1) * chunks, W=0.5, comm=0.1)
    s = get_schedule(name, p=4, m=8, chunks=chunks)
    res = simulate(s, costs)
    end = {e.action: e.end for e in res.timeline}
    assert len(res.timeline) == sum(len(a) for a in s.ranks)
    for e in res.timeline:
        for dep in dependencies(e.action, s):
            gap = 0.1 if s.rank_of(dep.stage) != e.rank else 0.0
            assert e.start >= end[dep] + gap - 1e-12, (e, dep)
    for r in range(4):  # in list order, never two at once on a rank
        mine = [e for e in res.timeline if e.rank == r]
        assert [e.action for e in mine] == list(s.ranks[r])
        assert all(a.end <= b.start + 1e-12 for a, b in zip(mine, mine[1:]))


def test_lowered_schedule_simulates_identically():
    s = get_schedule("zb-h1", p=4, m=6)
    assert simulate(lower_communication(s)).makespan == simulate(s).makespan


def test_host_time_overhead_on_one_rank():
    # one rank, no messages: the rank runs its 2m actions back to back with `overhead` between them (none after
    # the last: the step ends with the last compute); overhead is not busy time.
    for m in (1, 3, 5):
        res = simulate(get_schedule("gpipe", p=1, m=m), Costs(F=1, B=2, W=0.5, overhead=0.1))
        assert res.makespan == pytest.approx(m * 3.5 + (2 * m - 1) * 0.1)
        assert res.busy == pytest.approx((m * 3.5,))


def test_host_time_posting_messages_hand_derivation():
    # GPipe p=2 m=2 lowered: rank 0 runs 0F0 0SF0 0RB0 0F1 0SF1 0RB1 0B0 0B1, rank 1 runs
    # 1RF0 1RF1 1F0 1F1 1B0 1SB0 1B1 1SB1. F=1, full backward 2, comm 0.5, overhead 0.1, post 0.2:
    # rank 0: 0F0 [0,1] then 0.1 + 2 posts -> free 1.5; 0F1 [1.5,2.5].
    # rank 1: two receives posted first (0.4); 1F0 waits for 0F0 + 0.5 -> [1.5,2.5]; 1F1 waits 2.5 + 0.5 ->
    #   [3,4]; 1B0 after 0.1 -> [4.1,6.1]; then 0.1 + one send -> 1B1 [6.4,8.4].
    # rank 0: 0B0 waits 6.1 + 0.5 -> [6.6,8.6]; 0B1 waits 8.4 + 0.5 -> [8.9,10.9].
    s = lower_communication(get_schedule("gpipe", p=2, m=2))
    assert [str(a) for a in s.ranks[1]] == ["1RF0", "1RF1", "1F0", "1F1", "1B0", "1SB0", "1B1", "1SB1"]
    res = simulate(s, Costs(F=1, B=2, W=0, comm=0.5, overhead=0.1, post=0.2))
    starts = {str(e.action): (e.start, e.end) for e in res.timeline}
    want = {"0F0": (0, 1), "0F1": (1.5, 2.5), "1F0": (1.5, 2.5), "1F1": (3, 4), "1B0": (4.1, 6.1),
            "1B1": (6.4, 8.4), "0B0": (6.6, 8.6), "0B1": (8.9, 10.9)}
    for name, (a, b) in want.items():
        assert starts[name] == pytest.approx((a, b)), name
    assert res.makespan == pytest.approx(10.9) and res.busy == pytest.approx((6.0, 6.0))
    # a compute-only schedule holds no messages: post costs nothing there
    plain = simulate(get_schedule("gpipe", p=2, m=2), Costs(F=1, B=2, W=0, comm=0.5, post=0.2))
    assert plain.makespan == pytest.approx(simulate(get_schedule("gpipe", p=2, m=2),
                                                    Costs(F=1, B=2, W=0, comm=0.5)).makespan)


def test_deadlock_reported_not_hung():
    # Rank 0 waits for B0 before its second forward; rank 1 wants F1 before its first backward.
    broken = parse_schedule("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F0 1F1 1B0 1B1", name="broken")
    result: list[BaseException] = []
    t = threading.Thread(target=lambda: _capture(result, broken), daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "simulate hung on a deadlocked schedule"
    err = result[0]
    assert isinstance(err, ScheduleDeadlock)
    msg = str(err)
    assert "deadlocks" in msg
    assert ("rank 0 step 1: 0B0 waits for 1B0, which rank 1 runs at its step 2 "
            "but rank 1 is stuck at step 1 (1F1)") in msg
    assert ("rank 1 step 1: 1F1 waits for 0F1, which rank 0 runs at its step 2 "
            "but rank 0 is stuck at step 1 (0B0)") in msg
    assert "0B0 <blocked" in msg and "1F1 <blocked" in msg
    assert err.blocked == {0: 1, 1: 1}


def test_swapped_actions_in_generated_schedule_deadlock():
    # take a valid 1F1B and swap rank 0's first backward with its second forward: rank 0 then waits for
    # 1B0, which rank 1 only runs after 1F1, which needs rank 0's 0F1, now behind 0B0.
    s = get_schedule("1f1b", p=3, m=4)
    r0 = list(s.ranks[0])
    assert [str(a) for a in r0[:4]] == ["0F0", "0F1", "0F2", "0B0"]
    r0[1], r0[3] = r0[3], r0[1]
    text = "\n".join(" ".join(str(a) for a in acts) for acts in [r0, *s.ranks[1:]])
    with pytest.raises(ScheduleDeadlock, match=r"rank 1 step 1: 1F1 waits for 0F1, which rank 0 runs at its step 3 "
                                               r"but rank 0 is stuck at step 1 \(0B0\)") as info:
        simulate(parse_schedule(text))
    assert "rank 0 step 1: 0B0 waits for 1B0" in str(info.value)


def _capture(out: list[BaseException], schedule) -> None:
    try:
        simulate(schedule)
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        out.append(exc)


def test_bad_costs():
    s = get_schedule("1f1b", p=2, m=2)
    with pytest.raises(ValueError, match=r"cost F needs one value per stage \(2 for 2 stages\), got 3"):
        simulate(s, Costs(F=(1, 1, 1)))
    with pytest.raises(ValueError, match="cost comm must be >= 0"):
        simulate(s, Costs(comm=-1))
    with pytest.raises(ValueError, match="cost overhead must be >= 0"):
        simulate(s, Costs(overhead=-0.1))
    with pytest.raises(ValueError, match="cost post must be >= 0"):
        simulate(s, Costs(post=-1))
    with pytest.raises(ValueError, match="missing: 1B1"):
        simulate(Schedule(name="x", p=2, m=2, chunks=1, split_backward=False,
                          ranks=(s.ranks[0], tuple(a for a in s.ranks[1] if a != Action(1, "B", 1)))))
