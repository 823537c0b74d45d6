"""Document masking in parallel layouts against one process (fp32, relative 1e-5), on 2 CPU ranks.

Context parallelism (cp 2, the ring with per-document blocks; with activation checkpointing too): local logits and
every gradient summed over cp equal the one-process masked model's, whose documents each equal their run alone
(tests/unit/test_document_mask.py); the forward sends its cp−1 K/V blocks per layer and one all-gather of the rows'
EOS map. Tensor parallelism (tp 2) and pipelines (pp 2: 1f1b with full recomputation, zb-h1 with its split
backward; the documents reach every stage through ``microbatch_context``): logits / loss, evaluation and the
parameters after one SGD step. Without the micro-batch context a pipeline runs unmasked and misses by far.
The trainer's strategies (``enable_documents``: dp 2, tp 2, ZeRO-3 and pp 2 with recomputation, cp 2): step
losses and weights after two steps equal one process with the mask.
Rank side: tests/dist/docmask_checks.py.
"""
from __future__ import annotations

import pytest

from tests.dist import docmask_checks as dc

TOL = 1e-5


@pytest.mark.parametrize("kind,ckpt", [("gpt", False), ("llama", False), ("llama", True), ("gpt", True)],
                         ids=lambda x: str(x))
def test_ring_with_documents_matches_one_process(worlds, kind, ckpt):
    for res in worlds.get(2).run(dc.check_cp, dict(cp=2), kind, ckpt, timeout=240):
        assert res["logits"] < TOL and res["grads"] < TOL, res
        layers = 4 if kind == "gpt" else 2
        assert res["fwd"] == {"sends": layers * (res["cp"] - 1), "all_gather": 1}, res
        assert res["unmasked"] > 1e-2, res  # the mask changes the numbers the test compares


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_tensor_parallel_with_documents_matches_one_process(worlds, kind):
    for res in worlds.get(2).run(dc.check_tp, kind, timeout=240):
        assert res["logits"] < TOL and res["params"] < TOL, res


@pytest.mark.parametrize("kind,schedule,checkpoint", [("gpt", "1f1b", "full"), ("llama", "zb-h1", "none"),
                                                      ("llama", "1f1b", "selective")], ids=lambda x: str(x))
def test_pipeline_with_documents_matches_one_process(worlds, kind, schedule, checkpoint):
    for res in worlds.get(2).run(dc.check_pp, kind, schedule, checkpoint, timeout=240):
        assert res["loss"] < TOL and res["eval"] < TOL and res["params"] < TOL, res


def test_pipeline_without_the_microbatch_context_is_unmasked(worlds):
    for res in worlds.get(2).run(dc.check_pp, "gpt", "1f1b", "none", False, timeout=240):
        assert res["loss"] > 1e-3, res


def test_shardwise_train_layouts_with_documents_match_one_process(worlds):
    """The trainer's strategies (dp 2, tp 2, ZeRO-3 with recomputation, pp 2 with recomputation, cp 2) with
    ``enable_documents``: step losses and final weights equal one process with the mask (plain torch)."""
    ref = dc.runtime_reference()
    assert abs(ref["losses"][1] - ref["unmasked"][1]) > 1e-3  # the mask matters for these batches
    names = list(dc.RUNTIME)
    for per_rank in worlds.get(2).run(dc.check_runtime, names, timeout=480):
        for name, res in zip(names, per_rank):
            assert res["losses"] == pytest.approx(ref["losses"], rel=TOL), (name, res["losses"], ref["losses"])
            for k, want in ref["params"].items():
                assert float((res["params"][k] - want).abs().max()) <= 2e-5, (name, k)
