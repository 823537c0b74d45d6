"""The uneven all-to-all (``sw.comm.all_to_all_single``, ``exchange_counts``, ``all_to_all_autograd``) on worlds
of 1-4 ranks: native and pairwise both equal a hand-built reference (every dtype, row shape, zero pieces, a rank
that sends nothing, nothing at all), gradients equal a single-process reference, calls, bytes and messages are
counted, ``auto`` follows the calibration, and bad input is refused before any communication.

Rank-side code: tests/dist/alltoall_checks.py."""

from __future__ import annotations

import pytest

from shardwise.comm.alltoall import choose_all_to_all
from shardwise.comm.calibration import AlphaBeta, Calibration
from tests.dist import alltoall_checks as ac


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_algorithm_dtype_and_split_case_matches_the_reference(worlds, n):
    w = worlds.get(n)
    assert w.run(ac.check_matrix, timeout=240) == [[]] * n
    assert w.run(ac.check_exchange_counts) == [[]] * n


def test_axes_of_a_2x2_mesh(worlds):
    # the groups of a non-world axis: global ranks differ from coordinates along it
    w = worlds.get(4)
    assert w.run(ac.check_matrix, "b", {"a": 2, "b": 2}, timeout=240) == [[]] * 4
    assert w.run(ac.check_matrix, "a", {"a": 2, "b": 2}, timeout=240) == [[]] * 4


@pytest.mark.parametrize("n", [3, 4])
def test_async_calls_keep_their_order(worlds, n):
    assert worlds.get(n).run(ac.check_async_order) == [[]] * n


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("algorithm", ["native", "pairwise"])
def test_counter_sees_one_all_to_all_and_the_messages(worlds, n, algorithm):
    for r in worlds.get(n).run(ac.counts, algorithm):
        assert r["calls"] == r["algo_calls"] == 1 and r["bytes"] == r["want_bytes"], r
        if algorithm == "native":  # the backend's own: no point-to-point messages of ours
            assert (r["sent"], r["received"]) == (0, 0), r
        else:  # one message per non-empty off-diagonal piece, its own piece copied locally
            assert (r["sent"], r["bytes_sent"]) == (r["want_sent"], r["want_bytes_sent"]), r
            assert (r["received"], r["bytes_received"]) == (r["want_received"], r["want_bytes_received"]), r
    assert any(r["sent"] for r in worlds.get(n).run(ac.counts, "pairwise"))  # the split case moves something


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("algorithm", ["native", "pairwise"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_autograd_forward_and_backward(worlds, n, algorithm, dtype):
    for r in worlds.get(n).run(ac.check_gradients, algorithm, dtype):
        assert r["forward"] and r["grad"], r
        # two all-to-alls: the forward one and the reverse one of the gradient, same bytes each way in total
        assert r["calls"] == 2 and r["bytes"] == r["want_bytes"], r


@pytest.mark.parametrize("n", [1, 3])
def test_auto_follows_the_calibration(worlds, n):
    assert worlds.get(n).run(ac.check_auto) == [[]] * n


def test_choose_all_to_all_is_size_independent():
    def cal(native: tuple[float, float], pairwise: tuple[float, float] | None) -> Calibration:
        models = {"native": AlphaBeta(*native)} | ({"pairwise": AlphaBeta(*pairwise)} if pairwise else {})
        return Calibration(world_size=4, backend="gloo", device="cpu", models={"all_to_all": models})
    assert choose_all_to_all(None) == "native"
    assert choose_all_to_all(cal((10, 1e-3), None)) == "native"
    assert choose_all_to_all(cal((10, 1e-3), (5, 1e-3))) == "pairwise"
    assert choose_all_to_all(cal((10, 1e-3), (10, 1e-3))) == "native"  # a tie keeps the backend's
    assert choose_all_to_all(cal((10, 1e-3), (5, 2e-3))) == "native"  # crossover: cheaper only when small


@pytest.mark.parametrize("n", [1, 3])
def test_bad_input_is_refused_before_communication(worlds, n):
    for r in worlds.get(n).run(ac.errors):
        assert "in_splits has" in r["in_len"] and f"has {n} ranks" in r["in_len"], r
        assert "out_splits has" in r["out_len"], r
        assert f"sum to {n}" in r["in_sum"] and f"{n + 1} rows" in r["in_sum"], r
        assert f"sum to {n}" in r["out_sum"] and f"{n + 2} rows" in r["out_sum"], r
        assert "non-negative" in r["negative"], r
        assert "sends itself" in r["self"], r
        assert "must be integer row counts" in r["float"], r
        assert r["tensor_ints"] == "no error", r  # 0-d torch integers are row counts too
        assert "'ring' is unknown" in r["algorithm"], r
        assert "contiguous torch.float32 tensor of rows [2]" in r["row_shape"], r
        assert "1-D int64" in r["counts"], r
        assert "out_splits has" in r["autograd_len"], r
    # the world is still in step after all the refusals
    assert worlds.get(n).run(ac.check_exchange_counts) == [[]] * n


def test_debug_mesh_names_inconsistent_splits(worlds):
    for r in worlds.get(3).run(ac.debug_mismatch):
        assert "rank 0 sends 3 rows to 1, which expects 2" in r, r


def test_bench_comm_measures_both_all_to_alls_exactly(worlds):
    rows = worlds.get(3).run(ac.bench_rows)[0]
    # ring is not an all-to-all algorithm: left out; bf16 counts rounded down to a multiple of the 6 shares
    assert [(op, a, c) for op, a, c, _, _ in rows] == [
        ("all_to_all", alg, c) for c in (30, 510, 2046) for alg in ("native", "pairwise")]
    assert all(err == 0 for _, _, _, err, _ in rows), rows
    assert all(f == pytest.approx(2 / 3) for *_, f in rows), rows


def test_bench_comm_refuses_an_all_to_all_without_its_algorithms():
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "comm", "-n", "2", "--ops", "all_to_all",
                          "--algorithms", "ring,tree"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and res.stdout == "", res.stdout + res.stderr
    assert "--ops all_to_all runs native,pairwise but --algorithms ring,tree names none of them" in res.stderr
