"""A calibration's tiny block (``probe.block.tiny_s``) sets the per-launch overhead before the block factors are
solved, so a small micro-batch keeps its fixed per-launch cost instead of having it scaled away (pure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.planner import Hardware, Layout
from shardwise.planner.builders import gpt_layers
from shardwise.planner.compute import layer_time
from shardwise.planner.overhead import launch_overhead
from shardwise.planner.predict import block_factors

CAL = Path(__file__).resolve().parents[2] / "benchmarks" / "hardware_cpu_2ranks.json"


def _with_tiny(tmp_path: Path, tiny_s: float | None) -> Hardware:
    """The committed calibration with its tiny block set to ``tiny_s`` (``None``: a file from before it)."""
    raw = json.loads(CAL.read_text())
    raw["probe"]["block"].pop("tiny_s", None)
    if tiny_s is not None:
        raw["probe"]["block"]["tiny_s"] = tiny_s
    path = tmp_path / f"hw-{tiny_s}.json"
    path.write_text(json.dumps(raw))
    return Hardware.load(path)


def _per_sample(hw: Hardware, micro_batch: int) -> float:
    block = gpt_layers(n_layer=1, h=256, a=4, v=8, s=256, positions=256, tie=True, bias=True, dropout=False,
                       attention="flash")[1]
    t = layer_time(block, Layout(micro_batch=micro_batch), hw, flash=True, tp_per_node=1)
    return (t.F + t.B + t.W) / micro_batch


def test_the_tiny_block_sets_the_overhead_and_the_factors_still_fit_the_probe(tmp_path):
    plain = block_factors(_with_tiny(tmp_path, None))
    hw = block_factors(_with_tiny(tmp_path, 0.6e-3))  # 0.6 ms: what the tiny block takes on the 2-core VM
    assert hw.op_overhead_s == pytest.approx(launch_overhead(_with_tiny(tmp_path, None), 0.6e-3))
    assert hw.op_overhead_s > 3 * plain.op_overhead_s
    # the probe block (micro-batch 4) is still predicted at its measured time: the factors absorb the rest
    probe = hw.block_probe
    assert 4 * _per_sample(hw, 4) == pytest.approx(probe["fwd_s"] + probe["bwd_s"], rel=1e-6)
    assert 4 * _per_sample(plain, 4) == pytest.approx(probe["fwd_s"] + probe["bwd_s"], rel=1e-6)
    # ... while micro-batch 1 now pays more per sample than before (its launches are not 4x fewer)
    assert _per_sample(hw, 1) / _per_sample(hw, 4) > _per_sample(plain, 1) / _per_sample(plain, 4) + 0.02


def test_a_tiny_block_faster_than_its_arithmetic_changes_nothing(tmp_path):
    plain = block_factors(_with_tiny(tmp_path, None))
    hw = block_factors(_with_tiny(tmp_path, 1e-9))
    assert hw.op_overhead_s == plain.op_overhead_s
    assert (hw.fwd_factor, hw.bwd_factor) == pytest.approx((plain.fwd_factor, plain.bwd_factor))


def test_a_bad_tiny_time_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match="probe.block.tiny_s must be a positive number"):
        _with_tiny(tmp_path, -1.0)
