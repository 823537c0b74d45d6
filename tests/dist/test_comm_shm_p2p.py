"""Shared-memory point-to-point (``comm/shm_p2p.py``) on worlds of 2 and 4 ranks: bytes of every dtype and
shape arrive intact and in order, large messages stream through a small ring both ways at once without a
deadlock, messages are counted, bad input is refused, a dead peer is a named error; and ``sw.pipeline`` with
``transport="shm"`` trains to exactly the numbers of ``transport="native"``.

Rank-side code: tests/dist/shm_p2p_checks.py (link) and tests/dist/pipeline_checks.py (pipeline)."""

from __future__ import annotations

import pytest

from tests.dist import pipeline_checks as pc
from tests.dist import shm_p2p_checks as sc
from tests.dist.fault_worlds import survivors

SIZES = [2, 4]


@pytest.mark.parametrize("n", SIZES)
def test_link_moves_every_dtype_and_shape_in_order(worlds, n):
    w = worlds.get(n)
    assert w.run(sc.check_every_dtype_and_shape, timeout=240) == [[]] * n
    assert w.run(sc.check_completion_polling, timeout=120) == [[]] * n
    assert w.run(sc.leftover_segments) == [[]] * n


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_messages_larger_than_the_ring_stream_both_ways(worlds, n, order):
    # 30 messages of up to 300 KB per neighbour through a 4 KiB ring, both neighbours sending at once
    assert worlds.get(n).run(sc.check_streaming_both_ways, 30, order, timeout=240) == [[]] * n


@pytest.mark.parametrize("n", SIZES)
def test_comm_counter_records_messages(worlds, n):
    for r in worlds.get(n).run(sc.count_messages):
        # empty tensors send nothing; 10 float64 + 3 int8 each way
        assert r == {"sent": 2, "bytes_sent": 83, "received": 2, "bytes_received": 83, "records": 0}, r


def test_bad_inputs_and_mismatched_receive(worlds):
    for rank, r in enumerate(worlds.get(2).run(sc.check_bad_inputs)):
        assert "cannot send to coordinate" in r["self"] and f"coordinate {rank} of 2" in r["self"], r
        assert "cannot receive from coordinate 2" in r["range"], r
        assert "non-contiguous" in r["strided"] and "contiguous()" in r["strided"], r
        assert "40 bytes" in r["mismatch"] and "expects 48 bytes" in r["mismatch"], r
        assert "unusable" in r["after"], r
        assert r["still_ok"] == "True", r


def _survivors(target, n: int, victim: int) -> list[tuple]:
    return survivors(target, n, victim, "shm p2p")


@pytest.mark.parametrize("n,victim", [(2, 1), (4, 2)])
def test_dead_peer_mid_transfer_is_a_named_error_not_a_hang(n, victim):
    got = _survivors(sc.fault_rank, n, victim)
    assert sorted(r for r, *_ in got) == [r for r in range(n) if r != victim]
    for rank, (kind, message), _elapsed, later, exists in got:
        assert kind == "ShmPeerError", (rank, kind, message)
        assert f"rank {victim} " in message and "died" in message, message
        assert later.startswith("ShmPeerError") and "unusable" in later, later
        assert not exists  # the file was unlinked at set-up: nothing is left in /dev/shm


@pytest.mark.parametrize("n,victim", [(2, 0), (4, 1)])
def test_dead_stage_mid_step_is_a_named_error_not_a_hang(n, victim):
    got = _survivors(sc.pipeline_fault_rank, n, victim)
    assert sorted(r for r, *_ in got) == [r for r in range(n) if r != victim]
    for rank, (kind, message), _elapsed, exists in got:
        assert kind == "ShmPeerError" and f"rank {victim} " in message and "died" in message, (rank, message)
        assert not exists


PIPE_CASES = {
    2: [dict(schedule="1f1b", n_layer=2, m=3), dict(schedule="interleaved", n_layer=4, m=4, chunks=2)],
    4: [dict(schedule="zb-h1", n_layer=4, m=6), dict(schedule="gpipe", n_layer=2, m=3, dp=2)],
}


@pytest.mark.parametrize("n", SIZES)
def test_pipeline_over_shm_equals_native(worlds, n):
    for r in worlds.get(n).run(pc.check_transport_parity, PIPE_CASES[n], timeout=300):
        for case, got in zip(PIPE_CASES[n], r):
            assert got["resolved"] == ["shm", "native", "shm"], (case, got)  # shm, native, auto on one host
            assert got["losses_equal"] and got["params_equal"], (case, got)
            shm, native, auto = got["sends"]  # per step: (sends recorded as shm, as native)
            assert shm == auto and all(a == 0 for a, _ in native), (case, got)
            # the same stage messages on either transport; only the tied embedding/head exchange stays native
            for (s_shm, s_native), (_, n_native) in zip(shm, native):
                assert s_native == got["tied"] and s_shm == n_native - got["tied"] > 0, (case, got)


def test_pipeline_transport_across_hosts(worlds):
    for r in worlds.get(2).run(pc.check_transport_hosts, timeout=120):
        assert "transport='shm' needs every rank of axis 'pp' on one host" in r["shm"], r
        assert "fake-host-0" in r["shm"] and "transport='native'" in r["shm"] and r["shm_sends"] == "0", r
        assert r["auto"].startswith("ran native loss"), r
        assert "transport must be one of ('native', 'shm', 'auto'), got 'tcp'" in r["tcp"], r
