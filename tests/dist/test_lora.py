"""LoRA in every layout against peft's LoRA on one process (fp32: losses and adapters within 1e-5 relative; the
frozen base bit-identical after training), with the communication that the adapters add counted.
Rank-side code: tests/dist/lora_checks.py."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from tests.dist import lora_checks as lc  # noqa: E402

TOL = 1e-5


def _same_as_peft(out: dict) -> None:
    assert out["n_adapters"] == 2 * len(lc.TARGETS) * 2  # A and B of 7 targets in 2 layers
    assert out["adapters_moved"] > 1e-3  # training moved them: the comparison is not of initial values
    assert out["loss_err"] < TOL and out["adapter_err"] < TOL, out
    assert out["base_same"], "the frozen base changed"


def test_peft_model_under_tensor_parallelism(worlds):
    outs = worlds.get(2).run(lc.check_peft_tp)
    for out in outs:
        _same_as_peft(out)
    out = outs[0]
    # column layer q_proj (o=32, i=32, r=4): A whole (4, 32), B split on its rows like W (16, 4); row layer
    # o_proj: A split on its input (4, 16)
    assert (out["a_shape"], out["b_shape"], out["row_a_shape"]) == ((4, 32), (16, 4), (4, 16))
    # per step: forward 2 row layers x 2 blocks; backward the input gradients of the column groups that need one
    # (block 0's q/k/v input does not: the norm and embedding before it are frozen) = 3, and one gradient region
    # per block for the replicated factors (the adapters add no collective of their own)
    assert out["collectives"] == {"all_reduce": lc.STEPS * (4 + 3 + 2)}


def test_peft_model_under_data_parallelism(worlds):
    outs = worlds.get(2).run(lc.check_peft_dp)
    for out in outs:
        _same_as_peft(out)
    # only the adapters' gradients are averaged (the frozen base's 10x larger weights never cross the wire)
    per_step = outs[0]["reduced_bytes"] / lc.STEPS
    assert outs[0]["adapter_bytes"] <= per_step < 1.05 * outs[0]["adapter_bytes"], outs[0]


def test_peft_model_under_zero3(worlds):
    for out in worlds.get(2).run(lc.check_peft_zero3):
        _same_as_peft(out)


def test_peft_model_as_a_graph_pipeline(worlds):
    for out in worlds.get(2).run(lc.check_peft_pp):
        _same_as_peft(out)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_our_lora_matches_peft(worlds, layout):
    for out in worlds.get(2).run(lc.check_ours_layouts, layout):
        _same_as_peft(out)


def test_our_lora_tp2_inside_dp2(worlds):
    outs = worlds.get(4).run(lc.check_tp2dp2)
    for out in outs:
        _same_as_peft(out)
    per_step = outs[0]["dp_bytes"] / lc.STEPS  # this rank's adapter shards only
    assert outs[0]["adapter_bytes"] <= per_step < 1.05 * outs[0]["adapter_bytes"], outs[0]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_gpt_fused_qkv_lora_under_tp(worlds, sequence_parallel):
    # the fused q/k/v projection is split by whole heads of each of q, k, v: its adapter's B rows follow them
    for out in worlds.get(2).run(lc.check_gpt_tp, sequence_parallel):
        assert out["n_adapters"] == 2 * 4 * 2 and out["adapters_moved"] > 1e-3
        assert out["loss_err"] < TOL and out["adapter_err"] < TOL and out["base_same"], out


def test_peft_model_under_sw_auto(worlds):
    # sw.auto's plan names the LoRA layers' inner linears; the adapters still follow their base layers' split
    for out in worlds.get(2).run(lc.check_peft_auto):
        _same_as_peft(out)
        assert out["b_shape"] == (24, 4)  # up_proj (48 out) column-split: B's rows halved
        assert any(k.endswith("up_proj.base_layer") for k in out["split"]), out["split"]
