"""What one kernel launch costs in eager training, from a tiny block timed forward and backward (pure).

A bare ``tiny.add_`` costs 1-3 us on a CPU; in training every launch also pays Python, the module call,
autograd recording its node and the backward's dispatch — ~15 us each on the 2-core VM of benchmarks/RESULTS.md.
The cost model counts launches coarsely (a GEMM or an elementwise pass is one), so the overhead is solved
from a block small enough that its arithmetic is a few microseconds: the planner's time of that block is
linear in ``op_overhead_s`` (``t0 + launches × o``), and ``o = (measured − t0) / launches``. The quick probe
(``runtime/prediction.py``) and the calibration (``cli/calibrate_probe.py``, ``probe.block.tiny_s``) both time it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from .builders import gpt_layers
from .compute import layer_time
from .hardware import Hardware
from .plan import Layout

__all__ = ["TINY_BLOCK", "GPU_KERNEL_GAP_S", "launch_overhead", "with_launch_cost", "autocast_factor"]

GPU_KERNEL_GAP_S = 4e-6
"""Device-side cost between dependent kernels on a GPU whose host keeps it fed (the presets' ``op_overhead_s``)."""

TINY_BLOCK = {"n_embd": 64, "n_head": 2, "seq": 16, "batch": 1}
"""The reference GPT block timed for the launch overhead: micro-batch 1 of 16 tokens, width 64."""


def _tiny_block_time(hw: Hardware) -> Callable[[float], float]:
    """The planner's forward + backward seconds of the ``TINY_BLOCK`` block on ``hw`` as a function of the
    per-launch cost ``op_overhead_s`` (linear in it). The probe block has no factors of its own and no host
    launch model: it is priced with the kernels' costs alone."""
    t = TINY_BLOCK
    layer = gpt_layers(n_layer=1, h=t["n_embd"], a=t["n_head"], v=8, s=t["seq"], positions=t["seq"], tie=True,
                       bias=True, dropout=False, attention="flash")[1]
    plan = Layout(micro_batch=t["batch"])
    bare = replace(hw, fwd_factor=1.0, bwd_factor=1.0, host_launch_s=0.0)

    def total(o: float) -> float:
        lt = layer_time(layer, plan, replace(bare, op_overhead_s=o), flash=True, tp_per_node=1)
        return lt.F + lt.B + lt.W

    return total


def launch_overhead(hw: Hardware, measured_s: float) -> float:
    """The ``op_overhead_s`` with which the planner's forward + backward of the ``TINY_BLOCK`` block on ``hw``
    lasts ``measured_s`` (0 where the arithmetic alone already takes longer)."""
    total = _tiny_block_time(hw)
    t0 = total(0.0)
    launches = (total(1e-6) - t0) / 1e-6
    return max(measured_s - t0, 0.0) / launches if launches > 0 else 0.0


def host_launch(hw: Hardware, measured_s: float) -> float:
    """The ``host_launch_s`` with which the ``TINY_BLOCK`` forward + backward on a GPU ``hw`` lasts
    ``measured_s``: its kernels are microseconds of device work, so the host's launches set its time."""
    total = _tiny_block_time(hw)
    launches = total(1.0) - total(0.0)  # linear in the per-launch cost: the count of launches
    return measured_s / launches if launches > 0 else 0.0


def with_launch_cost(hw: Hardware, measured_s: float, *, gpu: bool, tiny2_s: float | None = None) -> Hardware:
    """``hw`` with the per-launch cost solved from the tiny block's measured forward + backward: on a GPU the
    host's issue time (``host_launch_s``, overlapping the device's work) next to the presets' kernel gap; on
    CPU ranks the additive ``op_overhead_s`` (never below the bare op's measured cost already in ``hw``).
    ``tiny2_s`` (GPU probes): two tiny blocks in one pass; ``tiny2_s - measured_s`` is one block's launches
    without the pass's fixed costs (a model of many blocks pays those once per micro-batch, not per block)."""
    if gpu:
        block_s = tiny2_s - measured_s if tiny2_s is not None and tiny2_s > measured_s else measured_s
        return replace(hw, op_overhead_s=GPU_KERNEL_GAP_S,
                       host_launch_s=max(hw.op_overhead_s, host_launch(hw, block_s)))
    return replace(hw, op_overhead_s=max(hw.op_overhead_s, launch_overhead(hw, measured_s)))


def autocast_factor(tiny_s: float, tiny_ac_s: float | None) -> float:
    """``Hardware.autocast_launch_factor`` from the tiny block timed in fp32 (``tiny_s``) and under bf16
    autocast (``tiny_ac_s``): autocast only adds work, so never below 1; 1 where it was not timed."""
    if tiny_ac_s is None or not tiny_s > 0:
        return 1.0
    return max(1.0, tiny_ac_s / tiny_s)
