"""ZeRO-3's communication in the planner: one gather (forward), one gather (backward) and one reduce-scatter per
unit per pass, each paying its own latency — what ``sw.zero`` stage 3 issues (pure)."""

from __future__ import annotations

import pytest

from shardwise.planner import Hardware, Layout, predict
from benchmarks.planner.published import megatron_spec


def _zero3(gpus: int, micro_batch: int):
    spec = megatron_spec(96, 12288, 96)  # GPT-3 175B, Narayanan et al. 2021 Table 2's ZeRO-3 model
    plan = Layout(dp=gpus, micro_batch=micro_batch, zero_stage=3, activation_checkpointing="full",
                precision="bf16-mixed")
    # megatron runtime: nothing overlapped, so the breakdown is the whole communication
    return predict(spec, plan, Hardware.preset("a100-80g-sxm"), global_batch=1536, runtime="megatron")


def test_zero3_pays_a_ring_latency_per_unit_collective():
    # Same bytes per device at 384 and 1,536 GPUs (the whole model is gathered twice and reduced once either
    # way); what grows is each ring's (P - 1) steps, paid by every one of the ~3 × 97 collectives per pass.
    hw = Hardware.preset("a100-80g-sxm")
    small, large = _zero3(384, 4), _zero3(1536, 1)
    units = 96 + 1  # one per block, plus the rest (embeddings, final norm, head)
    floor = 3 * units * (1535 - 383) * max(hw.intra.alpha_s, hw.inter.alpha_s)
    grown = large.breakdown["dp_comm"] - small.breakdown["dp_comm"]
    assert grown >= 0.9 * floor, (grown, floor)
    # and it is latency, not bandwidth: the growth stays within a few times that floor
    assert grown <= 3 * floor, (grown, floor)


@pytest.mark.parametrize("gpus,micro_batch", [(384, 4), (1536, 1)])
def test_zero3_communication_is_at_least_the_bytes_at_bus_bandwidth(gpus, micro_batch):
    hw = Hardware.preset("a100-80g-sxm")
    pred = _zero3(gpus, micro_batch)
    params = megatron_spec(96, 12288, 96).params
    bw, _ = hw.group_bus_bandwidth(gpus, hw.devices_per_node)
    # two bf16 gathers and one bf16 reduce-scatter of the whole model, each moving (P-1)/P of it per device
    floor = 3 * 2 * params * (gpus - 1) / gpus / bw
    assert pred.breakdown["dp_comm"] >= floor
