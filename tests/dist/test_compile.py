"""``sw.compile`` in the layouts that wrap a model's blocks: data parallelism, ZeRO 1 and 3, tensor parallelism with
sequence parallelism, each also under activation checkpointing. Rank side: tests/dist/compile_checks.py.

Compiled with inductor (the backend ``--train.compile`` uses; its C++ CPU kernels) against one process training
eagerly: losses, the first step's gradients and the parameters after 3 SGD steps within 1e-5 relative (fp32
summation order only); the collectives of each compiled run are those of the eager run, call for call.

Tensor parallelism runs under ``aot_eager`` (dynamo and AOTAutograd, no code generation): its block is cut into
~20 small graphs around the eager tensor-parallel layers, and generating C++ for each would cost minutes of the
suite's budget; what tp adds to compiling (the graph breaks at its layers, its collectives outside the graphs)
happens before the backend. The data-parallel and ZeRO layouts share one inductor graph of the block.
"""

from __future__ import annotations

from tests.dist import compile_checks as cc

LAYOUTS = [("dp", True, "inductor"), ("zero3", True, "inductor"), ("zero1", False, "inductor"),
           ("tp_sp", True, "aot_eager")]


def test_compiled_layouts_match_one_process(worlds):
    for res in worlds.get(2).run(cc.check_layouts, LAYOUTS, timeout=600):
        assert set(res) == {"dp+ac", "zero3+ac", "zero1", "tp_sp+ac"}, res
        for name, r in res.items():
            assert r["err"]["loss"] < 1e-5 and r["err"]["param"] < 1e-5, (name, r)
            assert r["err"].get("grad", 0.0) < 1e-5, (name, r)
            assert r["same_comm"] and r["n_comm"] > 0, (name, r)  # same collectives as eager, and some at all
            assert r["regions"] == cc.TINY["n_layer"] and r["recompiles"] == 0, (name, r)
