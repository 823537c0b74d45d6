"""Expert parallelism at the library level on 2 and 4 ranks against one process (rank side: moe_checks.py).

Tolerance: fp32, relative 1e-5 on every parameter and the balancing bias after two AdamW steps."""

from __future__ import annotations

import pytest

from tests.dist import moe_checks as mc

RTOL = 1e-5
CASES = [({}, "balancing loss, dropless"), ({"capacity_factor": 1.0}, "capacity 1.0"),
         ({"moe_bias_rate": 0.01, "moe_aux_loss_coef": 0.0, "router": "sigmoid"}, "bias method, sigmoid")]


@pytest.mark.parametrize("n,ep", [(2, 2), (4, 4), (4, 2)])
def test_expert_parallel_equals_one_process(worlds, n, ep):
    for kw, what in CASES:
        results = worlds.get(n).run(mc.check_ep, ep, kw, timeout=180)
        for r in results:
            assert r["err"] < RTOL, (n, ep, what, r["err"])
            assert r["losses"] != r["ref"] or n == 1  # per-rank losses are on this rank's rows only
        ops = results[0]["ops"]
        layers = 2
        # per MoE layer, forward: the counts exchange and two token all-to-alls
        assert ops.get("all_to_all", 0) == 3 * layers, (what, ops)
        assert results[0]["a2a_bytes"] > 0
