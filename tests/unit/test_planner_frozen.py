"""The planner with a frozen base (``ModelSpec.with_adapters``: LoRA): frozen parameters cost their bytes and
nothing else — no gradient, no optimizer state, no gradient reduction, no weight-gradient GEMMs — and every
layout's model state is derived from the element counts, not read back from the planner's own output."""

from __future__ import annotations

import pytest

from shardwise.planner import Hardware, Layout, ModelSpec, predict, search
from shardwise.planner.search import NoFeasiblePlan

H, L, FFN, V, S = 1024, 8, 2816, 32000, 512
R = 16
# LoRA on q, k, v, o and the three MLP matrices of each block (GQA: k, v of width H/2)
ADAPTER = R * ((H + H) + 2 * (H + H // 2) + (H + H) + 3 * (H + FFN))


def _specs() -> tuple[ModelSpec, ModelSpec]:
    full = ModelSpec.llama(n_layer=L, hidden=H, heads=16, kv_heads=8, ffn=FFN, vocab_size=V, seq_len=S)
    blocks = [layer.name for layer in full.layers if layer.kind == "block"]
    return full, full.with_adapters({name: ADAPTER for name in blocks})


def test_adapters_add_trainable_elements_and_freeze_the_base():
    full, lora = _specs()
    assert lora.params == full.params + L * ADAPTER
    for a, b in zip(full.layers, lora.layers):
        assert b.frozen == a.params
        assert b.params - b.frozen == (ADAPTER if a.kind == "block" else 0)


@pytest.mark.parametrize("zero, dp", [(0, 1), (1, 4), (3, 4)])
def test_model_state_is_the_base_bytes_plus_the_adapters_training_state(zero, dp):
    full, lora = _specs()
    hw = Hardware.preset("h100-80g-sxm")
    plan = Layout(dp=dp, zero_stage=zero, micro_batch=1)
    mem = predict(lora, plan, hw, global_batch=dp).memory
    base, adapters = full.params, L * ADAPTER
    shard = dp if zero >= 3 else 1
    assert mem.params == pytest.approx(4 * (base + adapters) / shard)
    assert mem.grads == pytest.approx(4 * adapters / (dp if zero >= 2 else 1))
    assert mem.optimizer == pytest.approx(8 * adapters / (dp if zero >= 1 else 1))  # AdamW's two fp32 moments


def test_data_parallel_reduces_only_the_adapters():
    full, lora = _specs()
    hw = Hardware.preset("h100-80g-sxm")
    plan = Layout(dp=8, micro_batch=1)
    f, lo = predict(full, plan, hw, global_batch=8), predict(lora, plan, hw, global_batch=8)
    # the adapters are 1/46 of the elements; the reduction's latency terms do not shrink with them
    assert lo.breakdown["dp_comm"] < f.breakdown["dp_comm"] / 5
    assert lo.breakdown["optimizer"] < f.breakdown["optimizer"] / 5


def test_no_weight_gradients_for_the_frozen_base():
    full, lora = _specs()
    hw = Hardware.preset("h100-80g-sxm")
    plan = Layout(micro_batch=4)
    f, lo = predict(full, plan, hw, global_batch=4), predict(lora, plan, hw, global_batch=4)
    # forward unchanged; backward loses the weight-gradient GEMMs (about a third of a dense step's FLOPs)
    assert lo.step_time_s < 0.8 * f.step_time_s
    assert lo.step_time_s > 0.55 * f.step_time_s


def test_with_seq_len_keeps_the_adapters():
    _, lora = _specs()
    longer = lora.with_seq_len(2 * S)
    assert longer.seq_len == 2 * S and longer.params == lora.params
    assert [x.frozen for x in longer.layers] == [x.frozen for x in lora.layers]


def test_unknown_layer_is_refused():
    full, _ = _specs()
    with pytest.raises(ValueError, match="does not have"):
        full.with_adapters({"blocks.99": 10})


def test_search_finds_a_layout_that_full_fine_tuning_cannot_fit():
    # a 8B-class decoder on 2 GPUs: full fine-tuning (16 B/param of state) does not fit on 2 x 80 GB without ZeRO-3
    # sharding everything; LoRA fits with plain data parallelism
    big = ModelSpec.llama(n_layer=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab_size=128256, seq_len=2048)
    blocks = [x.name for x in big.layers if x.kind == "block"]
    lora = big.with_adapters({b: 16 * 4 * (4096 + 4096) for b in blocks})
    hw = Hardware.preset("h100-80g-sxm")
    pins = {"zero_stage": 0, "tp": 1, "pp": 1}
    with pytest.raises(NoFeasiblePlan, match="largest: optimizer"):
        search(big, hw, devices=2, global_batch=8, pins=pins)
    best = search(lora, hw, devices=2, global_batch=8, pins=pins).predictions[0]
    assert best.fits and best.plan.dp * best.plan.cp == 2


def test_zero3_shards_the_frozen_base_inside_a_pipeline_too():
    # pp 2 x dp 4: ZeRO-3 keeps a quarter of each stage's elements, frozen ones included (parallel/pipeline/zero3.py's
    # frozen groups); ZeRO-2 keeps the parameters whole. The adapters' gradients and state do not depend on it.
    _, lora = _specs()
    hw = Hardware.preset("h100-80g-sxm")
    two, three = (predict(lora, Layout(dp=4, pp=2, zero_stage=z, micro_batch=1), hw, global_batch=8).memory
                  for z in (2, 3))
    assert three.params == pytest.approx(two.params / 4)
    assert three.grads == pytest.approx(two.grads) and three.optimizer == pytest.approx(two.optimizer)
