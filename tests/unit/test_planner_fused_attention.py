"""The attention core priced as an IO-aware fused kernel on GPUs (``compute.io_aware_attention``): ``O(s·h)``
traffic instead of the ``s × s`` scores, the unfused and CPU paths as before, and the Llama 3 405B rows that it
brings within the other published comparisons' range (pure, seconds)."""

from __future__ import annotations

import dataclasses

import pytest

from shardwise.planner import Hardware, Layout
from shardwise.planner.builders import gpt_layers, llama_layers
from shardwise.planner.compute import attention_time, io_aware_attention

H100 = Hardware.preset("h100-80g-sxm")
CPU = dataclasses.replace(H100, kind="cpu")
PLAN = Layout(micro_batch=1, precision="bf16-mixed")


def _block(s: int, attention: str = "flash"):
    return llama_layers(n_layer=1, h=4096, a=32, kv=8, f=14336, v=8, s=s, tie=False, attention=attention)[1]


def _roofline(layer, hw: Hardware, flash: bool) -> tuple[float, float]:
    """The per-GEMM roofline the unfused path (and CPU ranks) price the core with: the scores among the operands."""
    f = b = 0.0
    for g in layer.gemms:
        if g.weight:
            continue
        scale = 0.5 if (g.causal and flash) else 1.0
        t = hw.gemm_time(g.rows, g.n, g.k, dtype="bf16", batch=g.batch * scale, elem_bytes=2)
        f, b = f + t, b + (2.5 if flash else 2.0) * t
    return f, b


def test_the_decision_is_flash_on_a_gpu():
    assert io_aware_attention(True, H100)
    assert not io_aware_attention(False, H100)  # unfused (Megatron-LM 2021, Korthikanti 2022)
    assert not io_aware_attention(True, CPU)  # CPU ranks: the roofline their calibrations were compared under


@pytest.mark.parametrize("s", [1024, 8192, 131072])
def test_unfused_and_cpu_keep_the_roofline(s):
    unfused = _block(s, "unfused")
    assert attention_time(unfused, PLAN, H100, flash=False) == _roofline(unfused, H100, flash=False)
    fused = _block(s)
    assert attention_time(fused, PLAN, CPU, flash=True) == _roofline(fused, CPU, flash=True)


def test_long_sequences_stay_compute_bound_on_a_gpu():
    """At 131K tokens the roofline charges the scores' HBM traffic (memory-bound); the fused kernel is its FLOPs
    at the per-head GEMM efficiency, so its time grows as s² and its backward is 2.5× its forward (the proxy:
    a GPU without a published attention table; the H100 preset's table is tested in test_planner_kernels.py)."""
    H100 = dataclasses.replace(globals()["H100"], attention_table="")
    s = 131072
    block = _block(s)
    f, b = attention_time(block, PLAN, H100, flash=True)
    oh = H100.op_overhead_s
    assert b == pytest.approx(2.5 * (f - oh) + 2 * oh, rel=1e-9)  # one launch forward, two backward
    flops = sum(g.flops for g in block.gemms if not g.weight) / 2  # causal half
    compute = sum(g.flops / 2 / (H100.peak_flops["bf16"] * H100.gemm_efficiency(g.rows, g.n, g.k, "bf16"))
                  for g in block.gemms if not g.weight)
    assert f == pytest.approx(compute + H100.op_overhead_s, rel=1e-9)  # one launch, no traffic term
    assert f < _roofline(block, H100, flash=True)[0] / 1.5
    assert flops / f > 0.5 * H100.peak_flops["bf16"]
    f4, _ = attention_time(_block(s // 4), PLAN, H100, flash=True)
    assert f / f4 == pytest.approx(16, rel=0.02)


def test_short_sequences_and_tiny_heads_are_memory_bound_at_o_s_h():
    """A fused kernel still reads Q, K, V and writes O: a head dim of 8 at 64 tokens is bound by that traffic."""
    tiny = gpt_layers(n_layer=1, h=64, a=8, v=8, s=64, positions=64, tie=True, bias=True, dropout=False,
                      attention="flash")[1]
    slow = dataclasses.replace(H100, memory_bandwidth_Bps=1e6, op_overhead_s=0.0)
    f, b = attention_time(tiny, PLAN, slow, flash=True)
    io = 2 * (2 * 64 * 8 + 2 * 64 * 8) * 8 + 4 * 64 * 8  # Q, K, V, O in bf16 and the fp32 log-sum-exp, 8 heads
    assert f == pytest.approx(io / 1e6, rel=1e-9) and b == pytest.approx(2 * f, rel=1e-9)
