"""Expert parallelism inside a pipeline at the library level, against one process (rank side:
moe_pipeline_checks.py): pp 2 × dp 2 with the experts over ep 2 inside each stage, every schedule kind, with
gradient accumulation and ZeRO-1.

Tolerance: fp32, relative 1e-5 on every parameter (absolute on the balancing bias) after two AdamW steps."""

from __future__ import annotations

import pytest

from tests.dist import moe_pipeline_checks as mc

RTOL = 1e-5
BASE = dict(pp=2, dp=2, ep=2, m=2)
CASES = [
    dict(BASE, schedule="1f1b", accum=2),
    # zero-bubble: the balancing loss's gradient enters at the block output in B; the router weight's in W
    dict(BASE, schedule="zb-h1", accum=2),
    dict(BASE, schedule="gpipe", model=dict(capacity_factor=1.0)),
    dict(BASE, schedule="interleaved", chunks=2, accum=2),
    dict(BASE, schedule="zb-h1", zero=1, accum=2, model=dict(moe_bias_rate=0.01, moe_aux_loss_coef=0.0,
                                                             router="sigmoid")),
    dict(BASE, schedule="1f1b", zero=1, model=dict(capacity_factor=1.0)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()
                                                              if k not in ("pp", "dp", "ep", "m", "model"))
                         + ("-" + "-".join(c["model"]) if "model" in c else ""))
def test_moe_pipeline_equals_one_process(worlds, case):
    results = worlds.get(4).run(mc.run_case, case, timeout=240)
    passes = case.get("accum", 1) * case["m"]
    for rank, r in enumerate(results):
        assert r["err"] < RTOL, (rank, case, r["err"])
        assert r["in_buckets"] == 0 and r["n_experts"] == 2, r  # one MoE block per rank, outside the dp buckets
        for got, want in zip(r["losses"], r["ref"]):
            assert abs(got - want) <= RTOL * abs(want), (r["losses"], r["ref"])
        # per MoE block and micro-batch: 3 all-to-alls forward (counts, tokens out and back), 2 in backward;
        # zero-bubble's W differentiates a stage with an MoE block again (its router returns a tuple: no weight
        # capture), two more on the stage that also needs input gradients (stage 1)
        extra = 2 * passes if case["schedule"] == "zb-h1" and rank >= 2 else 0
        assert r["a2a"] == 5 * passes + extra, (rank, r["a2a"])


def test_balancing_loss_weight_is_visible():
    """The parity above sees a lost balancing-loss gradient or a weight 1 / m instead of 1 / (m · accum)."""
    assert mc.aux_matters({}, 0.0) > 1e-2
    assert mc.aux_matters({}, 2.0) > 1e-2
