"""Asynchronous tensor parallelism (``async_tp=True``): the overlapped column/row layers equal the plain ones and
one device (GPT at tp 2, 3, 4 with and without sequence parallelism, uneven sequence pieces; the Llama with
separate q/k/v and gate/up projections), over gloo and shared memory, and move the same bytes."""

from __future__ import annotations

import pytest

from tests.dist import overlap_checks as oc

L = oc.TINY["n_layer"]


def _same_bytes(results: list[dict]) -> None:
    # summed over ranks: a ring all-reduce of uneven pieces sends a rank more or less than another
    plain = sum(r["bytes"]["ring"][0] for r in results)
    fast = sum(r["bytes"]["ring"][1] for r in results)
    assert plain == fast > 0, (plain, fast)


def test_functions_tp2_uneven(worlds):
    msg = worlds.get(2).run(oc.check_bad_flag)[0]
    assert "async_tp must be a bool" in msg and "'yes'" in msg and "\n" not in msg
    counts = worlds.get(2).run(oc.check_functions, 2, 15)
    # a ring of 2 ranks: one hop forward, one backward, each carrying the other rank's chunk (8 or 7 tokens)
    for c in counts:
        assert c["gather_linear"][0] == 2 and c["linear_scatter"][0] == 2
    # (2, t_j, 12) fp64 pieces: forward this rank's x chunk, backward the partial dX of the other rank's chunk
    # (8 + 7 tokens on either rank): the bytes of one all-gather plus one reduce-scatter over a ring of 2
    row = 2 * 12 * 8
    assert [c["gather_linear"][1] for c in counts] == [(8 + 7) * row] * 2
    # the row layer's partial product (2, t, 6) and its output gradient (2, t_j, 6)
    assert [c["linear_scatter"][1] for c in counts] == [(8 + 7) * 2 * 6 * 8] * 2


@pytest.mark.parametrize("sp", [False, True])
def test_gpt_tp2(worlds, sp):
    w = worlds.get(2)
    # the ring algorithm (bytes comparable) and shared memory (the hops over the shm link); the Llama check
    # below runs the default native collectives
    res = w.run(oc.check_async_parity, 2, "gpt", sp, 15, None, ("ring", "shm"))
    _same_bytes(res)
    recs = res[0]["async"]["ring"]
    if sp:  # per block 2 gathers + 2 scatters, and the LM head's gather, in forward; conjugates in backward
        assert recs == {"all_gather": 2 * L + 1 + 2 * L, "reduce_scatter": 2 * L, "all_reduce": 0}, recs
    else:
        assert recs == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}, recs


def test_gpt_tp3_tp4(worlds):
    # the ring transport only: the overlapped hops are the same p2p messages under any collective algorithm
    # one block (the layers repeat): 16 tokens over 3 ranks = 6 + 5 + 5, over 4 = 4 each
    for sp in (False, True):
        _same_bytes(worlds.get(3).run(oc.check_async_parity, 3, "gpt", sp, 16,
                                      {"n_head": 3, "n_embd": 48, "n_layer": 1}, ("ring",)))
    _same_bytes(worlds.get(4).run(oc.check_async_parity, 4, "gpt", True, 16, {"n_layer": 1}, ("ring",)))


def test_llama_separate_projections(worlds):
    worlds.get(2).run(oc.check_async_parity, 2, "llama", True, 15, None, ("native",))
