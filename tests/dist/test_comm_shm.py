"""``algorithm="shm"`` on worlds of 2 and 4 ranks: equal to native everywhere, counted, chosen by auto only on
one host, and a dead peer is a named error instead of a hang."""

from __future__ import annotations

import pytest

from tests.dist import shm_checks as sc
from tests.dist.fault_worlds import survivors

SIZES = [2, 4]


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_every_dtype_op_length_equals_native(worlds, n):
    assert worlds.get(n).run(sc.check_all_reduce_matrix, timeout=300) == [[]] * n


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_in_many_pieces_equals_native(worlds, n):
    # 1 KiB pieces: every length above 256 floats crosses many slots, odd tails included.
    assert worlds.get(n).run(sc.check_all_reduce_matrix, 1024, timeout=300) == [[]] * n


@pytest.mark.parametrize("n", SIZES)
def test_shapes_and_bit_identical_sums(worlds, n):
    w = worlds.get(n)
    assert w.run(sc.check_shapes) == [[]] * n
    assert w.run(sc.check_bit_identical_sums, timeout=240) == [[]] * n


@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_all_gather_broadcast_equal_native(worlds, n):
    w = worlds.get(n)
    assert w.run(sc.check_reduce_scatter, timeout=300) == [[]] * n
    assert w.run(sc.check_all_gather, timeout=300) == [[]] * n
    assert w.run(sc.check_broadcast, timeout=300) == [[]] * n


@pytest.mark.parametrize("n", SIZES)
def test_async_handles(worlds, n):
    assert worlds.get(n).run(sc.check_async, timeout=240) == [[]] * n


@pytest.mark.parametrize("n", SIZES)
def test_many_consecutive_calls_wrap_the_slots(worlds, n):
    calls = 2001
    for r in worlds.get(n).run(sc.check_many_calls, calls, timeout=240):
        assert r["failures"] == [], r
        assert r["pieces"] == calls and calls > 100 * r["slots"]  # one piece per call; slots reused ~500 times


def test_two_axes_of_one_mesh_alternately(worlds):
    results = worlds.get(4).run(sc.check_two_axes_alternately, 20, timeout=240)
    for r in results:
        assert r["failures"] == [], r
        assert r["names"]["dp"] != r["names"]["tp"]  # one segment per axis group
    # ranks of one group share its segment; the two dp groups ({0,2}, {1,3}) have different ones
    names = [r["names"] for r in results]
    assert names[0]["dp"] == names[2]["dp"] and names[1]["dp"] == names[3]["dp"] != names[0]["dp"]
    assert names[0]["tp"] == names[1]["tp"] and names[2]["tp"] == names[3]["tp"] != names[0]["tp"]


@pytest.mark.parametrize("n", SIZES)
def test_comm_counter_records_shm(worlds, n):
    for r in worlds.get(n).run(sc.count_records):
        assert r["records"] == [("all_reduce", "shm", 4000, n), ("all_gather", "shm", 40, n),
                                ("reduce_scatter", "shm", 40 * n, n), ("broadcast", "shm", 40, n)]
        assert r["messages"] == 0  # nothing went through point-to-point messages


def test_debug_signature_check_covers_shm(worlds):
    for r in worlds.get(2).run(sc.check_debug_mode):
        assert r["ok"] == "ok"
        assert "disagree" in r["mismatch"] and "numel" in r["mismatch"], r


def test_auto_picks_shm_only_on_one_host(worlds):
    for r in worlds.get(2).run(sc.check_auto, False):
        assert r == ["shm", "shm", "no error", "values ok"], r
    for r in worlds.get(2).run(sc.check_auto, True):  # every rank claims another host
        assert r[:2] == ["ring", "ring"] and r[3] == "values ok", r  # the cheapest of the others
        assert "one host" in r[2] and "fake-host-0" in r[2] and "fake-host-1" in r[2], r


@pytest.mark.parametrize("n", SIZES)
def test_no_segment_file_is_left_after_setup(worlds, n):
    assert worlds.get(n).run(sc.leftover_segments) == [[]] * n


@pytest.mark.parametrize("n,victim", [(2, 1), (4, 2)])
def test_dead_peer_is_a_named_error_not_a_hang(n, victim):
    got = survivors(sc.fault_rank, n, victim, "shm")
    assert sorted(r for r, *_ in got) == [r for r in range(n) if r != victim]
    for rank, (kind, message), _elapsed, later, exists in got:
        assert kind == "ShmPeerError", (rank, kind, message)
        assert f"rank {victim} " in message and "died" in message and "all_reduce" in message, message
        assert later.startswith("ShmPeerError") and "unusable" in later, later
        assert not exists  # the file was unlinked at set-up: nothing is left in /dev/shm


@pytest.mark.parametrize("n", SIZES)
def test_data_parallel_with_shm_matches_native(worlds, n):
    assert worlds.get(n).run(sc.check_data_parallel_gradients, timeout=240) == [[]] * n
