"""``sw.auto`` plans applied on spawned ranks: values and gradients equal one device's, the communication
pattern is the one the plan implies, and every rank plans the same without communicating."""

from __future__ import annotations

import importlib.util

import pytest

from tests.dist import auto_checks as ac

L = 2  # decoder layers in the test models


@pytest.mark.parametrize("which", ["own", "hf"])
def test_llama_plan_is_megatron_and_trains_like_one_device(worlds, which):
    if which == "hf" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    a, b = worlds.get(2).run(ac.check_llama, which)
    assert a["plan"] == b["plan"] and a["planning_comms"] == b["planning_comms"] == 0
    leaves = {k.rsplit(".", 1)[-1]: v for k, v in a["styles"].items()}
    assert leaves == {"q_proj": "ColumnParallel(heads=8)", "k_proj": "ColumnParallel(heads=4)",
                      "v_proj": "ColumnParallel(heads=4)", "o_proj": "RowParallel()",
                      "gate_proj": "ColumnParallel(heads=None)", "up_proj": "ColumnParallel(heads=None)",
                      "down_proj": "RowParallel()"}, a["plan"]
    assert not a["vocab_loss"]
    # forward: one all-reduce per column -> row pair (attention, MLP) per layer, nothing else
    assert a["fwd"] == {"all_reduce": 2 * L}
    # backward: the conjugate all-reduce of the column layers' input gradient, one per group reading one tensor
    # (q, k, v share one; gate and up another): 2 per layer, Megatron's count
    assert a["bwd"] == {"all_reduce": 2 * L}


def test_classifier_partial_fc(worlds):
    results = worlds.get(4).run(ac.check_classifier)
    r = results[0]
    assert all(x["styles"] == r["styles"] for x in results) and r["planning_comms"] == 0
    assert r["styles"] == {"head": "VocabParallel()"} and r["tp"] == "tp" and r["dp"] == ("dp",)
    assert r["local_head_rows"] == 10000  # 20000 classes over tp=2
    assert r["fwd"] == 0  # the backbone is data parallel and the head's input is already whole
    assert r["loss"] == 2  # vocab-parallel cross-entropy: max, then (sum-exp, target logit)
    assert r["bwd_tp"] == 1  # the head's input gradient (features) summed over the class shards
    assert r["bwd_dp"] >= 1  # gradient buckets over the data axis


def test_a_plan_for_a_layer_reading_the_raw_input_runs(worlds):
    a, b = worlds.get(2).run(ac.check_raw_input_layer)
    assert a == b and a["tp"] == "tp"
    assert a["styles"]["inp"] == "ColumnParallel(heads=None)" and a["styles"]["up"] == "RowParallel()", a


def test_small_model_pure_data_parallel(worlds):
    a, b = worlds.get(2).run(ac.check_small_model)
    assert a["planning_comms"] == 0 and a["fwd"] == 0
    assert a["bwd"] == {"all_reduce": 1}  # one gradient bucket
