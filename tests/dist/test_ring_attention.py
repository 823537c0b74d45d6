"""Context parallelism (ring attention) against one device, in one spawned world of 4 ranks and one of 3.

Ring attention forward and backward (dq, dk, dv) against ``F.scaled_dot_product_attention`` on the full
sequence (fp32, relative 1e-5): causal and not, grouped-query attention (h=4 with hkv=2 and 1), uneven head dims
(and a value head dim unlike the key's), batch > 1, bf16 (relative 2e-2 against fp32), the flash and the math
blocks; over ``Mesh(cp=4)``, ``Mesh(dp=2, cp=2)``, ``Mesh(cp=2, tp=2)`` (non-contiguous cp groups) and
``Mesh(cp=3)``. Messages and bytes each rank sends are counted: forward cp−1 K/V transfers, backward cp−1 K/V
transfers and cp dK/dV transfers (fp32), nothing else. The same ring on a contiguous split (the wrong layout)
misses by far, so a wrong chunk order is caught.
Models under ``context_parallel``: a ``transformers`` ``LlamaForCausalLM`` (tiny config, sdpa attention; its
own loss through ``shift_labels=``), the reference GPT and our Llama (``sequence_layout``), with and without
activation checkpointing: local logits and every parameter gradient (summed over cp) equal one device's; with
``sw.DataParallel`` over cp, and over dp of dp×cp. Bad inputs raise one line before any message.
Rank side: tests/dist/context_checks.py.
"""
from __future__ import annotations

import pytest

from tests.dist import context_checks as cc

TOL = 1e-5
BF16_TOL = 2e-2  # bf16 inputs against the fp32 reference on the same (rounded) values
MESHES4 = [dict(cp=4), dict(dp=2, cp=2), dict(cp=2, tp=2)]


def _ring_cases(axes: dict) -> list[dict]:
    base = dict(axes=axes, b=2, h=4, S=12 * axes["cp"])
    return [
        dict(base, hkv=4, d=12, causal=True),
        dict(base, hkv=2, d=12, causal=True, seed=1),
        dict(base, hkv=1, d=10, dv=6, causal=True, seed=2),
        dict(base, hkv=4, d=12, causal=False, seed=3),
        dict(base, hkv=2, d=10, dv=6, causal=False, seed=4),
        dict(base, b=1, hkv=1, d=8, causal=True, S=4 * axes["cp"], seed=5)  # chunks of 2,
    ]


def _assert_ring(per_rank: list[list[dict]], cases: list[dict]) -> None:
    for k, case in enumerate(cases):
        for res in per_rank:
            r = res[k]
            tol = TOL if case.get("dtype", "float32") == "float32" else BF16_TOL
            assert max(r["out"], r["dq"], r["dk"], r["dv"], r["unshard"]) < tol, (case, r)
            assert r["wrong_layout"] > 1e-2 or not case["causal"], (case, r)
            flash = case.get("impl", "auto") == "auto" and case.get("dv", case["d"]) == case["d"]
            assert r["blocks"] == ("flash" if flash else "math"), (case, r)
            cp, b, s = r["cp"], case["b"], case["S"] // r["cp"]
            elems = b * case["hkv"] * s * (case["d"] + case.get("dv", case["d"]))  # one K/V block
            size = 2 if case.get("dtype") == "bfloat16" else 4
            assert r["fwd"]["messages"] == r["fwd"]["sends"] == cp - 1, (case, r)
            assert r["fwd"]["bytes"] == (cp - 1) * elems * size and r["fwd"]["other"] == 0, (case, r)
            assert r["bwd"]["messages"] == 2 * cp - 1 == r["bwd"]["received"], (case, r)
            assert r["bwd"]["bytes"] == (cp - 1) * elems * size + cp * elems * 4 and r["bwd"]["other"] == 0, (case, r)


@pytest.mark.parametrize("axes", MESHES4, ids=lambda a: "x".join(f"{k}{v}" for k, v in a.items()))
def test_ring_attention_matches_one_device(worlds, axes):
    cases = _ring_cases(axes)
    _assert_ring(worlds.get(4).run(cc.check_ring, cases, timeout=240), cases)


def test_ring_attention_on_three_ranks(worlds):
    cases = _ring_cases(dict(cp=3))[:3] + _ring_cases(dict(cp=3))[-1:]
    _assert_ring(worlds.get(3).run(cc.check_ring, cases, timeout=240), cases)


def test_bad_inputs_raise_before_communicating(worlds):
    for res in worlds.get(4).run(cc.check_errors, dict(cp=4), timeout=60):
        assert res["messages"] == 0, res
        assert "dropout_p=0.1" in res["dropout"] and "set dropout 0 with context parallelism" in res["dropout"]
        assert "shard_sequence" in res["odd"] and "heads" in res["heads"] and "'sp'" in res["axis"], res
        assert "S=6 must be divisible by 2·cp=8" in res["shard"], res
        assert all("\n" not in v for v in res.values() if isinstance(v, str)), res
    for res in worlds.get(4).run(cc.check_model_errors, dict(cp=4), timeout=60):
        assert res["messages"] == 0 and res["modes"] == 0 and res["outside_messages"] == 0, res
        assert "attn_mask of shape (8, 8)" in res["mask"], res
        assert "dropout_p=0.1" in res["dropout"] and "set dropout 0" in res["dropout"], res


MODELS = [("hf-llama", False, dict(cp=4)), ("hf-llama", True, dict(dp=2, cp=2)), ("hf-llama", False, dict(cp=2, tp=2)),
          ("gpt", False, dict(cp=4)), ("gpt", True, dict(cp=2, tp=2)),
          ("llama", False, dict(dp=2, cp=2)), ("llama", True, dict(cp=4))]


@pytest.mark.parametrize("kind,ckpt,axes", MODELS, ids=lambda x: str(x))
def test_model_matches_one_device(worlds, kind, ckpt, axes):
    for res in worlds.get(4).run(cc.check_model, axes, kind, ckpt, timeout=240):
        assert res["logits"] < TOL and res["grads"] < TOL and not res["missing"], res
        assert res["fwd"]["messages"] == res["layers"] * (res["cp"] - 1), res
        assert res["modes"] == (0, 0), res
        assert res["layouts"] == {"hf-llama": 0, "gpt": 1, "llama": res["layers"]}[kind], res


def test_hf_own_loss_needs_shift_labels_and_then_matches(worlds):
    for res in worlds.get(4).run(cc.check_hf_own_loss, dict(dp=2, cp=2), timeout=120):
        assert "shift_labels=" in res["refused"] and "\n" not in res["refused"], res
        assert res["grads"] < TOL and res["explicit_positions"] < TOL, res


@pytest.mark.parametrize("axes", [dict(cp=4), dict(dp=2, cp=2)], ids=["cp4", "dp2xcp2"])
def test_with_data_parallel_matches_one_device(worlds, axes):
    for res in worlds.get(4).run(cc.check_with_data_parallel, axes, timeout=120):
        assert res["grads"] < TOL, res
