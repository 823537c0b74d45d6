"""``sw.compile`` in the layouts that wrap a model's blocks: data parallelism, ZeRO 1 and 3, tensor parallelism with
sequence parallelism, each also under activation checkpointing. Rank side: tests/dist/compile_checks.py.

Compiled with inductor (the backend ``--train.compile`` uses; its C++ CPU kernels) against one process training
eagerly: losses, the first step's gradients and the parameters after 3 SGD steps within 1e-5 relative (fp32
summation order only); the collectives of each compiled run are those of the eager run, call for call.
"""

from __future__ import annotations

from tests.dist import compile_checks as cc

LAYOUTS = [("dp", True), ("zero3", True), ("zero1", False), ("tp_sp", False), ("tp_sp", True)]


def test_compiled_layouts_match_one_process(worlds):
    for res in worlds.get(2).run(cc.check_layouts, LAYOUTS, "inductor", timeout=600):
        assert set(res) == {"dp+ac", "zero3+ac", "zero1", "tp_sp", "tp_sp+ac"}, res
        for name, r in res.items():
            assert r["err"]["loss"] < 1e-5 and r["err"]["param"] < 1e-5, (name, r)
            assert r["err"].get("grad", 0.0) < 1e-5, (name, r)
            assert r["same_comm"] and r["n_comm"] > 0, (name, r)  # same collectives as eager, and some at all
            assert r["regions"] == cc.TINY["n_layer"] and r["recompiles"] == 0, (name, r)
