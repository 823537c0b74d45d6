"""Pipeline schedules as data: text form, completeness, dependency order, lowering to send/receive, bad input."""

from __future__ import annotations

import pytest

from shardwise.parallel.pipeline.actions import Action, parse_action, parse_actions, parse_schedule
from shardwise.parallel.pipeline.communication import lower_communication, message_order, receive_placement
from shardwise.parallel.pipeline.schedules import get_schedule
from shardwise.parallel.pipeline.simulate import simulate

SIZES = [(p, m) for p in (1, 2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 12)]


def _cases():
    for p, m in SIZES:
        for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
            yield name, p, m, 1
        if m % p == 0:
            for chunks in (2, 3):
                yield "interleaved", p, m, chunks


CASES = list(_cases())


def test_text_form_round_trips():
    assert str(Action(1, "F", 0)) == "1F0"
    assert str(Action(0, "B", 3)) == "0B3"
    assert str(Action(2, "W", 5)) == "2W5"
    assert str(Action(12, "SEND_F", 10)) == "12SF10"
    assert parse_action("1F0") == Action(1, "F", 0)
    assert parse_action(" 0B3 ") == Action(0, "B", 3)
    assert parse_action("1RB7") == Action(1, "RECV_B", 7)
    assert parse_actions("0F0, 0F1 - 0B0") == [Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0)]
    for kind in ("F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"):
        a = Action(3, kind, 11)
        assert parse_action(str(a)) == a


@pytest.mark.parametrize("bad", ["", "F0", "1X0", "1F", "-1F0", "1f0x"])
def test_parse_action_rejects_garbage(bad):
    with pytest.raises(ValueError, match="cannot parse pipeline action"):
        parse_action(bad)


@pytest.mark.parametrize("name,p,m,chunks", CASES)
def test_every_action_exactly_once_on_its_rank(name, p, m, chunks):
    s = get_schedule(name, p=p, m=m, chunks=chunks)
    split = name in ("zb-h1", "zb-h2")
    kinds = ("F", "B", "W") if split else ("F", "B")
    assert s.split_backward == split
    got = sorted(a for acts in s.ranks for a in acts)
    want = sorted(Action(st, k, i) for st in range(p * chunks) for k in kinds for i in range(m))
    assert got == want
    for r, acts in enumerate(s.ranks):
        # interleaved assignment: stage = chunk * p + rank
        assert {a.stage for a in acts} == {c * p + r for c in range(chunks)}


@pytest.mark.parametrize("name,p,m,chunks", CASES)
def test_dependencies_respected_in_a_global_order(name, p, m, chunks):
    # Independent of the simulator: repeatedly take any rank's next action whose inputs are done.
    s = get_schedule(name, p=p, m=m, chunks=chunks)
    last = p * chunks - 1
    done: set[tuple[int, str, int]] = set()
    pos = [0] * p
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while pos[r] < len(s.ranks[r]):
                a = s.ranks[r][pos[r]]
                st, i = a.stage, a.microbatch
                needs = {"F": [(st - 1, "F", i)] if st > 0 else [],
                         "B": [(st, "F", i)] + ([(st + 1, "B", i)] if st < last else []),
                         "W": [(st, "B", i)]}[a.kind]
                if not all(n in done for n in needs):
                    break
                done.add((st, a.kind, i))
                pos[r] += 1
                moved = True
    assert pos == [len(acts) for acts in s.ranks], f"{name} p={p} m={m} stuck at {pos}"


def test_one_f_one_b_and_gpipe_shapes_p4_m8():
    # hand-written expectations for rank 0 and the last rank
    one = get_schedule("1f1b", p=4, m=8)
    assert [str(a) for a in one.ranks[0][:6]] == ["0F0", "0F1", "0F2", "0F3", "0B0", "0F4"]
    assert [str(a) for a in one.ranks[3][:4]] == ["3F0", "3B0", "3F1", "3B1"]
    gp = get_schedule("gpipe", p=2, m=3)
    assert gp.to_text() == "rank 0: 0F0 0F1 0F2 0B0 0B1 0B2\nrank 1: 1F0 1F1 1F2 1B0 1B1 1B2"


def test_zb_h1_postpones_r_weight_gradients_on_rank_r():
    s = get_schedule("zb-h1", p=3, m=4)
    assert s.to_text().splitlines() == [
        "rank 0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3",
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3",
    ]


def test_zb_h2_listing_p2_m4():
    # Hand-built from the ZB-H2 rules (p=2, m=4): rank 0 warms up with 2p-1 = 3 forwards, rank 1 with 1.
    # Steady steps j <= m-2p = 0: B_j W_j F. Tail: rank 1 still has 2r = 2 forwards, so B F B F, then its
    # postponed W's; rank 0 has none left, so B W B W. Unit times (rank 1 shifted by 1):
    #   rank 0: F0 0, F1 1, F2 2, B0 3 (1B0 ends at 3), W0 4, F3 5, B1 6, W1 7, B2 8, W2 9, B3 10, W3 11 -> 12
    #   rank 1: F0 1, B0 2, W0 3, F1 4, B1 5, F2 6, B2 7, F3 8, B3 9, W1 10, W2 11, W3 12 -> 13
    s = get_schedule("zb-h2", p=2, m=4)
    assert s.to_text().splitlines() == [
        "rank 0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3",
        "rank 1: 1F0 1B0 1W0 1F1 1B1 1F2 1B2 1F3 1B3 1W1 1W2 1W3",
    ]


@pytest.mark.parametrize("p", (1, 2, 3, 4, 8))
def test_zb_h2_warmup_and_steady_state(p):
    for m in (1, p, 2 * p - 1, 2 * p, 3 * p + 2):
        s = get_schedule("zb-h2", p=p, m=m)
        for r, acts in enumerate(s.ranks):
            kinds = "".join(a.kind for a in acts)
            # warm-up: 2(p-r)-1 forwards (capped at m) before the first B -- ZB-H1 runs only p-r
            assert kinds.index("B") == min(2 * (p - r) - 1, m), (p, m, r)
            # steady state (m >= 2p): B_j W_j F for j = 0 .. m-2p, right after the warm-up
            steady = kinds[kinds.index("B"):][:3 * max(m - 2 * p + 1, 0)]
            assert steady == "BWF" * max(m - 2 * p + 1, 0), (p, m, r)
            # every list ends with a W; the last B is followed only by W's
            assert kinds.endswith("W") and set(kinds[kinds.rindex("B") + 1:]) == {"W"}


def test_interleaved_megatron_order():
    s = get_schedule("interleaved", p=2, m=4, chunks=2)
    # rank 0 holds stages 0 and 2; forwards go in groups of p=2 micro-batches per chunk
    fwd = [str(a) for a in s.ranks[0] if a.kind == "F"]
    assert fwd == ["0F0", "0F1", "2F0", "2F1", "0F2", "0F3", "2F2", "2F3"]
    bwd = [str(a) for a in s.ranks[0] if a.kind == "B"]
    assert bwd == ["2B0", "2B1", "0B0", "0B1", "2B2", "2B3", "0B2", "0B3"]


def test_schedule_text_round_trip_and_grid():
    s = get_schedule("zb-h1", p=4, m=8)
    back = parse_schedule(s.to_text(), name="zb-h1")
    assert back.ranks == s.ranks and back.split_backward and back.p == 4 and back.m == 8
    grid = s.grid().splitlines()
    assert grid[0].split() == ["step", "rank", "0", "rank", "1", "rank", "2", "rank", "3"]
    assert grid[1].split() == ["0", "0F0", "1F0", "2F0", "3F0"]
    assert len(grid) == 1 + max(len(a) for a in s.ranks)


def test_parse_schedule_rejects_incomplete():
    with pytest.raises(ValueError, match=r"missing: 1B0"):
        parse_schedule("0F0 0B0\n1F0")
    with pytest.raises(ValueError, match="wrong rank: 1F0 on rank 0"):
        parse_schedule("0F0 0B0 1F0\n1B0")


@pytest.mark.parametrize("name,p,m,chunks", [c for c in CASES if c[1] in (2, 3, 4)])
def test_lowered_communication_pairs_in_order(name, p, m, chunks):
    s = lower_communication(get_schedule(name, p=p, m=m, chunks=chunks))
    n_boundaries_crossing = p * chunks - 1 if p > 1 else 0
    sends = [a for acts in s.ranks for a in acts if a.kind.startswith("SEND")]
    assert len(sends) == 2 * m * n_boundaries_crossing  # one activation + one gradient per boundary
    for (src, dst), (sent, received) in message_order(s).items():
        assert sent == received, f"rank {src}->{dst}: sends {sent} but receives {received}"
    for acts in s.ranks:  # every receive precedes its consumer, every send follows its producer
        index = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind == "RECV_F":
                assert index[a] < index[Action(a.stage, "F", a.microbatch)]
            if a.kind == "RECV_B":
                assert index[a] < index[Action(a.stage, "B", a.microbatch)]
            if a.kind in ("SEND_F", "SEND_B"):
                assert index[a] > index[Action(a.stage, a.kind[-1], a.microbatch)]


def test_single_rank_needs_no_communication():
    s = lower_communication(get_schedule("interleaved", p=1, m=3, chunks=2))
    assert all(a.is_compute for acts in s.ranks for a in acts)


@pytest.mark.parametrize("kwargs,match", [
    (dict(name="pipedream", p=2, m=4), r"unknown pipeline schedule 'pipedream'; valid schedules: gpipe, 1f1b"),
    (dict(name="1f1b", p=0, m=4), r"p \(pipeline ranks\) must be an integer >= 1, got 0"),
    (dict(name="1f1b", p=2, m=0), r"m \(micro-batches\) must be an integer >= 1, got 0"),
    (dict(name="1f1b", p=2, m=4, chunks=2), r"one model chunk per rank, got chunks=2"),
    (dict(name="zb-h2", p=2, m=4, chunks=2), r"'zb-h2' runs one model chunk per rank, got chunks=2"),
    (dict(name="zb-h2", p=2, m=0), r"m \(micro-batches\) must be an integer >= 1, got 0"),
    (dict(name="interleaved", p=2, m=4, chunks=1), r"needs chunks >= 2"),
    (dict(name="interleaved", p=4, m=6, chunks=2), r"multiple of p .* got m=6, p=4; use m=4 or m=8"),
    (dict(name="interleaved", p=4, m=2, chunks=2), r"got m=2, p=4; use m=4$"),
])
def test_bad_input(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        get_schedule(name, **kwargs)


def _consumer(recv: Action) -> Action:
    return Action(recv.stage, "F" if recv.kind == "RECV_F" else "B", recv.microbatch)


@pytest.mark.parametrize("recv_before_send", [False, True])
@pytest.mark.parametrize("ahead", [0, 1, 2])
@pytest.mark.parametrize("name,p,m,chunks", [c for c in CASES if c[1] in (2, 4)])
def test_receives_posted_ahead_of_their_consumer(name, p, m, chunks, ahead, recv_before_send):
    """Each receive is posted before the compute action ``ahead`` places earlier than its consumer on that
    rank (earlier still when the sender's order or the before-send rule requires), and the pairing stays in
    send order."""
    s = lower_communication(get_schedule(name, p=p, m=m, chunks=chunks), recv_ahead=ahead, recv_before_send=recv_before_send)
    for (src, dst), (sent, received) in message_order(s).items():
        assert sent == received, (ahead, src, dst)
    late = lower_communication(get_schedule(name, p=p, m=m, chunks=chunks), recv_ahead=0, recv_before_send=False)
    for acts, late_acts in zip(s.ranks, late.ranks):
        compute = [a for a in acts if a.is_compute]
        assert compute == [a for a in late_acts if a.is_compute]  # lowering never reorders compute
        assert sorted(acts) == sorted(late_acts)  # the same sends and receives, only placed differently
        index = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind in ("RECV_F", "RECV_B"):
                k = compute.index(_consumer(a))
                assert index[a] < index[compute[max(0, k - ahead)]], (name, ahead, str(a))
                if ahead == 0 and not recv_before_send:  # the late placement: only receives between it and its consumer
                    between = acts[index[a] + 1:index[_consumer(a)]]
                    assert all(b.kind in ("RECV_F", "RECV_B") for b in between), (name, str(a))


def _producer(recv: Action) -> Action:
    return Action(recv.stage - 1, "F", recv.microbatch) if recv.kind == "RECV_F" else \
        Action(recv.stage + 1, "B", recv.microbatch)


@pytest.mark.parametrize("name,p,m,chunks", [c for c in CASES if c[1] in (2, 4)])
def test_receives_posted_before_their_message_is_sent(name, p, m, chunks):
    """In the unit-cost simulated run, every receive is posted (the compute action that follows it starts)
    before its sender's producing action ends, unless it is posted before the rank's first action; with the
    rule off (late placement), some receives are not (so the check can fail)."""
    schedule = get_schedule(name, p=p, m=m, chunks=chunks)
    run = simulate(schedule)
    start = {e.action: e.start for e in run.timeline}
    end = {e.action: e.end for e in run.timeline}

    def late_posts(lowered):
        late = []
        for acts in lowered.ranks:
            first = next(a for a in acts if a.is_compute)
            for i, a in enumerate(acts):
                if a.kind in ("RECV_F", "RECV_B"):
                    nxt = next(b for b in acts[i:] if b.is_compute)
                    if nxt != first and start[nxt] >= end[_producer(a)]:
                        late.append(str(a))
        return late

    assert late_posts(lower_communication(schedule)) == []
    if p == 4 and m >= 4:
        assert late_posts(lower_communication(schedule, recv_ahead=0, recv_before_send=False))


def test_receive_ahead_text_form_1f1b():
    # Unit costs (F = 1, whole B = 2): rank 0 sends F1 at t=2 while rank 1 runs F0 (from t=1), so rank 1 posts
    # RF1 at the start; F2 leaves at t=7, during rank 1's B1 (from t=5): RF2 goes before B1, together with
    # B0's send before it — torch's 1F1B steady-state pairing. Rank 0 posts each gradient receive one
    # compute action before its consumer (recv_ahead=1), which is also before its send.
    s = lower_communication(get_schedule("1f1b", p=2, m=3))
    assert s.to_text().splitlines() == [
        "rank 0: 0F0 0SF0 0RB0 0F1 0SF1 0B0 0RB1 0F2 0SF2 0RB2 0B1 0B2",
        "rank 1: 1RF0 1RF1 1F0 1B0 1SB0 1F1 1RF2 1B1 1SB1 1F2 1B2 1SB2",
    ]
    assert lower_communication(get_schedule("1f1b", p=2, m=3), recv_before_send=False).to_text().splitlines() == [
        "rank 0: 0F0 0SF0 0RB0 0F1 0SF1 0B0 0RB1 0F2 0SF2 0RB2 0B1 0B2",
        "rank 1: 1RF0 1F0 1RF1 1B0 1SB0 1F1 1RF2 1B1 1SB1 1F2 1B2 1SB2",
    ]


def test_receive_placement_defaults_by_device():
    # gloo progresses transfers on the host: post early; NCCL's ordered stream: just before the consumer
    assert receive_placement("cpu") == (1, True)
    assert receive_placement("cuda") == (0, False)
    assert receive_placement("cuda", 2, True) == (2, True) and receive_placement("cpu", 0, False) == (0, False)


@pytest.mark.parametrize("ahead", [-1, 1.5, True, "1"])
def test_receive_ahead_bad_input(ahead):
    with pytest.raises(ValueError, match=r"recv_ahead must be an integer >= 0 .* got"):
        lower_communication(get_schedule("1f1b", p=2, m=2), recv_ahead=ahead)
