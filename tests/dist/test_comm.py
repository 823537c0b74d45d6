"""Collectives against exact expected results on worlds of 1–4 ranks, plus message counts and bad input."""

from __future__ import annotations

import pytest

from tests.dist import comm_checks as cc

ALGS = ["native", "ring", "tree"]
SIZES = [1, 2, 3, 4]


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_every_algorithm_op_dtype_length(worlds, n):
    results = worlds.get(n).run(cc.check_all_reduce_matrix, ALGS, timeout=240)
    assert results == [[]] * n, results


@pytest.mark.parametrize("n", [3, 4])
def test_all_reduce_pipelined_pieces(worlds, n):
    # Tiny pieces force many messages per chunk: the pipelined forwarding path of ring and tree.
    results = worlds.get(n).run(cc.check_all_reduce_matrix, ["ring", "tree"], 64, timeout=240)
    assert results == [[]] * n, results


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("algorithm", ALGS)
def test_all_reduce_shapes_in_place(worlds, n, algorithm):
    assert worlds.get(n).run(cc.check_all_reduce_shapes, algorithm) == [[]] * n


@pytest.mark.parametrize("n", [3, 4])
@pytest.mark.parametrize("algorithm", ["ring", "tree"])
def test_random_floats_agree_with_native(worlds, n, algorithm):
    errs = worlds.get(n).run(cc.check_random_floats_match_native, algorithm)
    assert max(errs) < 1e-5


@pytest.mark.parametrize("n", [2, 3, 4])
def test_message_counts(worlds, n):
    length = 1200  # divisible by 2, 3, 4; one piece per chunk
    w = worlds.get(n)
    native = w.run(cc.count_all_reduce_messages, "native", length)
    assert native == [(1, 0, 0)] * n  # one collective, no point-to-point traffic of ours
    ring = w.run(cc.count_all_reduce_messages, "ring", length)
    # Ring: 2(n-1) steps, one message each, each carrying a 1/n chunk: 2(n-1)/n of the buffer per rank.
    assert ring == [(1, 2 * (n - 1), 2 * (n - 1) * (length // n) * 4)] * n
    tree = w.run(cc.count_all_reduce_messages, "tree", length)
    # Tree: every non-root sends the whole buffer once up; every edge carries it once down: 2(n-1) in total.
    assert sum(m for _, m, _ in tree) == 2 * (n - 1)
    assert sum(b for _, _, b in tree) == 2 * (n - 1) * length * 4
    # Nobody sends more than 1 (up) + 2 (down to children) messages: latency ~ tree depth, not n.
    assert max(m for _, m, _ in tree) <= 3
    assert all(c == 1 for c, _, _ in tree)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algorithm", ALGS)
def test_all_gather_reduce_scatter_broadcast(worlds, n, algorithm):
    w = worlds.get(n)
    assert w.run(cc.check_all_gather, algorithm) == [[]] * n
    assert w.run(cc.check_reduce_scatter, algorithm) == [[]] * n
    assert w.run(cc.check_broadcast, algorithm) == [[]] * n


@pytest.mark.parametrize("n", [1, 3, 4])
def test_all_to_all_and_send_recv(worlds, n):
    w = worlds.get(n)
    assert w.run(cc.check_all_to_all) == [[]] * n
    assert w.run(cc.check_send_recv_ring) == [[]] * n


@pytest.mark.parametrize("algorithm", ALGS)
def test_async_handles_keep_order(worlds, algorithm):
    assert worlds.get(3).run(cc.check_async, algorithm) == [[]] * 3


@pytest.mark.parametrize("algorithm", ALGS)
def test_axes_of_a_2x2_mesh(worlds, algorithm):
    assert worlds.get(4).run(cc.check_2d_mesh_axes, algorithm) == [[]] * 4


@pytest.mark.parametrize("kind,word", [("length", "numel"), ("op", "op"), ("dtype", "dtype")])
def test_debug_mode_turns_mismatch_into_error(worlds, kind, word):
    msgs = worlds.get(2).run(cc.debug_mismatch, kind)
    for msg in msgs:
        assert "disagree" in msg and word in msg and "rank 0" in msg and "rank 1" in msg, msg


@pytest.mark.parametrize("case,words", [
    ("algorithm", ["butterfly", "native", "ring", "tree"]),
    ("avg_int", ["avg", "int64", "sum"]),
    ("op", ["prod", "sum"]),
    ("axis", ["tp", "dp"]),
    ("a2a_ring", ["ring", "all_to_all", "native"]),
    ("ring_dtype", ["complex64", "native"]),
    ("bcast_src", ["99", "size"]),
    ("gather_sizes", ["sizes", "entry"]),
    ("mesh_product", ["multiply", "world size"]),
])
def test_bad_input_is_a_clear_error(worlds, case, words):
    for msg in worlds.get(2).run(cc.bad_input, case):
        assert msg != "no error"
        for word in words:
            assert word in msg, (word, msg)


def test_auto_runs_the_cheapest_calibrated_algorithm(worlds):
    for r in worlds.get(4).run(cc.check_auto_algorithm):
        assert r["small"] == ["tree", "tree"] and r["large"] == ["ring", "ring"], r
        assert r["messages_small"] > 0 and r["messages_large"] > 0, r  # point-to-point traffic: really ours
        assert r["same"] and r["sub"], r
        assert r["fallback"] == ["native"] * 3, r
        assert r["dp"] and set(r["dp"]) == {"tree"}, r  # DataParallel(algorithm="auto") goes through it too
