"""The planner's pricing of ZeRO-2/3 inside pipelines (``parallel/pipeline/zero3.py``'s policy): gradients reduced
once per step, so the step holds the rank's full gradients; ZeRO-3 holds 1/dp of the parameters plus two
gathered units, and pays 2m all-gathers per unit and step."""

from __future__ import annotations

import dataclasses

from shardwise.planner import Hardware, Layout, ModelSpec, predict
from shardwise.planner.ledger import layout_floor

SPEC = ModelSpec.gpt(n_layer=8, n_embd=512, n_head=8, vocab_size=4096, seq_len=256, block_size=256)
HW = Hardware.preset("a100-80g-sxm")
BASE = Layout(dp=2, pp=2, micro_batch=1, schedule="1f1b")


def _pred(zero: int, gb: int = 16, **kw) -> object:
    return predict(SPEC, dataclasses.replace(BASE, zero_stage=zero, **kw), HW, global_batch=gb)


def test_zero3_in_a_pipeline_holds_a_parameter_shard_and_the_steps_full_gradients():
    one, two, three = _pred(1), _pred(2), _pred(3)
    assert abs(three.memory.params - one.memory.params / 2) <= 1e-6 * one.memory.params  # 1/dp of the parameters
    assert two.memory.params == one.memory.params
    # ZeRO-1 keeps full gradient buffers; ZeRO-2/3 hold the step's full gradients, which become the shard
    for zero in (two, three):
        assert zero.memory.grads == one.memory.grads / 2
        assert zero.memory.buffers >= one.memory.grads / 2  # the rest of the full gradients, during the step
    assert three.memory.total < one.memory.total
    floors = {z: layout_floor(SPEC, dataclasses.replace(BASE, zero_stage=z), global_batch=16) for z in (1, 3)}
    for f1, f3 in zip(floors[1], floors[3]):
        assert f3.params < f1.params and f3.gathered > 0 and f3.comm >= f3.grads  # the step's full gradients


def test_zero3_in_a_pipeline_pays_its_gathers_per_micro_batch():
    """2m all-gathers per unit and step: more micro-batches per step, more ZeRO-3 communication; ZeRO-1's
    reduction does not grow with them."""
    few, many = _pred(3, gb=4), _pred(3, gb=16)
    assert many.plan.microbatches > few.plan.microbatches
    assert many.breakdown["dp_comm"] > few.breakdown["dp_comm"]
    assert _pred(1, gb=16).breakdown["dp_comm"] < many.breakdown["dp_comm"]


def test_bf16_mixed_counts_the_fp32_gradient_the_step_reads():
    """bf16-mixed: the optimizer steps fp32 masters with an fp32 gradient, 4 bytes per master element on the rank;
    the floor and the prediction are the larger of backward's and the step's. fp32 has no such term."""
    for zero in (1, 3):
        plan = Layout(dp=4, micro_batch=1, zero_stage=zero, precision="bf16-mixed")
        floor = layout_floor(SPEC, plan, global_batch=16)[0]
        assert floor.step == 4 * floor.optimizer / 12, floor  # AdamW bf16-mixed: 12 bytes of master and state
        assert floor.total >= floor.params + floor.grads + floor.optimizer + floor.step
        pred = predict(SPEC, plan, HW, global_batch=16).memory
        assert pred.step == floor.step and pred.training >= pred.params + pred.grads + pred.optimizer + pred.step
    fp32 = layout_floor(SPEC, Layout(dp=4, micro_batch=1, zero_stage=1), global_batch=16)[0]
    assert fp32.step == 0.0
