"""Graph pipelines (``sw.pipeline(..., example_inputs=...)``) of third-party decoders against one device.

Hugging Face ``transformers`` Llama (GQA, untied head) and Qwen2 (q/k/v biases, embedding tied to the head) built
from a small config, and a model of our own (keyword inputs, a mask and position ids used by every layer, a skip
connection, a dataclass output), under every schedule, with checkpointing, pp x dp and pp x tp: losses and
trained parameters (``sw.full_state_dict``, the original keys) equal one device's SGD within fp32 rounding.
Decoders with ``use_cache`` at its default (True: each forward makes a ``DynamicCache`` its layers fill) train
the same 2 steps to one device's losses: the cache is made anew for every call (and every checkpointed
recomputation), so nothing of one step or micro-batch reaches the next.
Communication: whatever crosses a boundary (hidden states, position ids, rotary cos and sin) travels as ONE
message per micro-batch each way, plus one metadata message per boundary on the first step, plus one message
each way for the tied embedding/head — the same count as a chain pipeline (``test_pipeline._expected_sends``).
Rank-side code: tests/dist/pipeline_graph_checks.py.
"""

from __future__ import annotations

import pytest

from tests.dist import pipeline_graph_checks as gc
from tests.dist.test_pipeline import _expected_sends

pytest.importorskip("transformers")

TOL = 1e-5
CASES = {
    2: [
        dict(model="toy", schedule="1f1b", m=2),
        dict(model="toy", schedule="zb-h1", m=2, loss_fn=True),  # loss_fn on the dataclass output
        # both architectures under every schedule
        dict(model="llama", schedule="gpipe", m=2),
        dict(model="llama", schedule="1f1b", m=4, split=["model.layers.1"]),
        dict(model="llama", schedule="interleaved", m=2, chunks=2),
        dict(model="llama", schedule="zb-h1", m=2),
        dict(model="llama", schedule="zb-h2", m=4, split=["model.layers.3"]),
        dict(model="qwen2", schedule="gpipe", m=2, checkpoint=True),
        dict(model="qwen2", schedule="1f1b", m=2),
        dict(model="qwen2", schedule="interleaved", m=2, chunks=2),
        dict(model="qwen2", schedule="zb-h1", m=2, checkpoint=True),
        dict(model="qwen2", schedule="zb-h2", m=4),
        # use_cache left at True: a DynamicCache made inside every forward, never sent, never kept between calls
        dict(model="llama", schedule="1f1b", m=2, cache=True),
        dict(model="qwen2", schedule="zb-h1", m=2, cache=True, checkpoint=True),
    ],
    4: [
        dict(model="llama", schedule="1f1b", m=2, dp=2),
        dict(model="qwen2", schedule="zb-h1", m=2, tp=2),
        dict(model="llama", schedule="1f1b", m=4, split=["model.layers.1", "model.layers.2", "model.layers.3"]),
    ],
}


def _tie(case: dict) -> int:
    return int(case["model"] == "qwen2")


@pytest.mark.parametrize("n", [2, 4])
def test_graph_pipelines_match_one_device(worlds, n):
    per_rank = worlds.get(n).run(gc.check_parity, CASES[n], timeout=400)
    for k, case in enumerate(CASES[n]):
        for rank_out in per_rank:
            got = rank_out[k]
            assert got["loss_err"] < TOL and got["param_err"] < TOL, (case, got["loss_err"], got["param_err"])
            assert got["keys_ok"], case
            assert got["made"] == (["DynamicCache"] if case.get("cache") else []), (case, got["made"])
            p = 2 if n == 2 or "dp" in case or "tp" in case else 4
            first, later = _expected_sends({**case, "tie": _tie(case)}, got["coord"], p)
            assert got["sends"] == [first] + [later] * (len(got["sends"]) - 1), (case, got["sends"], first, later)
            assert got["tied"] == (_tie(case) if got["coord"] in (0, p - 1) else 0), case
            if case["model"] != "toy":  # position ids, cos, sin and the hidden states cross every boundary
                assert got["n_send"][:-1] == [4] * (len(got["n_send"]) - 1) and got["n_send"][-1] == 0, case
