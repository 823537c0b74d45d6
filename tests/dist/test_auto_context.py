"""``sw.auto`` offers context parallelism: on ``Mesh(cp=2)`` and ``Mesh(cp=2, tp=2)`` the plan of the reference
GPT (gpt-tiny, dropout 0) and of a ``transformers`` ``LlamaForCausalLM`` (tiny config, sdpa attention), traced
on the full sequence, carries ``"": ContextParallel(axis="cp")``; ``sw.parallelize`` applies it after the
tensor-parallel styles; each rank's local logits and every parameter gradient (gathered over tp, summed over cp)
equal one device's (relative 1e-5), and planning sends nothing. Rank side: tests/dist/auto_context_checks.py."""

from __future__ import annotations

import importlib.util

import pytest

from tests.dist import auto_context_checks as acc

TOL = 1e-5
CASES = [(dict(cp=2), "gpt", False), (dict(cp=2), "hf-llama", False), (dict(cp=2, tp=2), "gpt", False),
         (dict(cp=2, tp=2), "hf-llama", True)]


@pytest.mark.parametrize("axes, kind, pinned", CASES,
                         ids=lambda v: "x".join(f"{k}{n}" for k, n in v.items()) if isinstance(v, dict) else str(v))
def test_auto_plan_with_cp_matches_one_device(worlds, axes, kind, pinned):
    if kind == "hf-llama" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    results = worlds.get(2 * axes.get("tp", 1)).run(acc.check_auto_cp, axes, kind, pinned, timeout=240)
    for r in results:
        assert r["planning_comms"] == 0 and r["plan"] == results[0]["plan"]
        assert r["cp"] == "cp" and r["styles"][""] == "ContextParallel(axis='cp')", r["plan"]
        assert "cp" not in r["dp"] and r["tp"] != "cp"
        assert "attention ring, sequence split 2·cp = 4 ways" in r["context"], r["context"]
        assert not r["missing"] and r["logits"] < TOL and r["grads"] < TOL, r
        if pinned:  # the tp axis splits the Llama's q/k/v/o and MLP
            assert r["tp"] == "tp" and r["styles"]["model.layers.*.self_attn.o_proj"] == "RowParallel()", r["plan"]
