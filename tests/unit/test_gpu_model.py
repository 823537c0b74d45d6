"""The planner's GPU host model (pure): a GPU fed by an eager host costs max(device work, host launches) per
phase; the tiny block solves the host's launch cost; torch's foreach AdamW launches per chunk of tensors on a
GPU; a single-GPU calibration measured on an H200 predicts that GPU's measured steps (benchmarks/)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from shardwise.planner import Hardware, Layout
from shardwise.planner.builders import gpt_layers
from shardwise.planner.compute import layer_time
from shardwise.planner.overhead import GPU_KERNEL_GAP_S, TINY_BLOCK, host_launch, with_launch_cost
from shardwise.planner.step_extras import optimizer_time
from shardwise.runtime.config import load_config, parse_overrides

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
H100 = Hardware.preset("h100-80g-sxm")


def _block(h: int = 768, s: int = 1024) -> object:
    return gpt_layers(n_layer=1, h=h, a=12, v=8, s=s, positions=s, tie=True, bias=True, dropout=False,
                      attention="flash")[1]


def _total(hw: Hardware, layer: object, mb: int) -> float:
    t = layer_time(layer, Layout(micro_batch=mb, precision="bf16"), hw, flash=True, tp_per_node=1)
    return t.F + t.B + t.W


def test_host_launches_bound_small_work_and_hide_under_large():
    layer = _block()
    launches = _total(replace(H100, op_overhead_s=1.0), layer, 1) - _total(replace(H100, op_overhead_s=0.0), layer, 1)
    assert 20 < launches < 200  # a transformer block's forward + backward kernels
    slow_host = replace(H100, host_launch_s=50e-6)
    # micro-batch 1 of 1,024 tokens on an H100: ~0.3 ms of device work, ~launches × 50 us of host
    assert _total(slow_host, layer, 1) == pytest.approx(launches * 50e-6, rel=1e-9)
    # 64 sequences: the device's work exceeds the host's launches, which then cost nothing extra
    assert _total(slow_host, layer, 64) == pytest.approx(_total(H100, layer, 64), rel=1e-9)
    # max per phase, not per kernel: never above the sum of device and host
    for mb in (1, 4, 16):
        both = _total(H100, layer, mb) + launches * 50e-6
        got = _total(slow_host, layer, mb)
        assert max(_total(H100, layer, mb), launches * 50e-6) <= got * (1 + 1e-12) and got <= both * (1 + 1e-12)


def test_cpu_ranks_pay_launches_on_top_of_the_work():
    layer = _block(h=256, s=256)
    cpu = replace(H100, kind="cpu", op_overhead_s=20e-6)
    launches = _total(replace(cpu, op_overhead_s=1.0), layer, 2) - _total(replace(cpu, op_overhead_s=0.0), layer, 2)
    assert _total(cpu, layer, 2) == pytest.approx(_total(replace(cpu, op_overhead_s=0.0), layer, 2)
                                                  + launches * 20e-6, rel=1e-9)


def test_the_tiny_block_round_trips_through_the_host_launch_cost():
    t = TINY_BLOCK
    tiny = gpt_layers(n_layer=1, h=t["n_embd"], a=t["n_head"], v=8, s=t["seq"], positions=t["seq"], tie=True,
                      bias=True, dropout=False, attention="flash")[1]
    measured = 1.5e-3  # a host-bound fwd + bwd: far above the tiny block's device work on an H100
    hw = with_launch_cost(H100, measured, gpu=True)
    assert hw.op_overhead_s == GPU_KERNEL_GAP_S and hw.host_launch_s == pytest.approx(host_launch(H100, measured))
    got = layer_time(tiny, Layout(micro_batch=t["batch"]), hw, flash=True, tp_per_node=1)
    assert got.F + got.B + got.W == pytest.approx(measured, rel=1e-6)
    # on CPU ranks the same measurement becomes an additive op overhead instead
    cpu = with_launch_cost(replace(H100, kind="cpu"), measured, gpu=False)
    assert cpu.host_launch_s == 0.0 and cpu.op_overhead_s > H100.op_overhead_s


def test_foreach_adamw_launches_per_chunk_on_a_gpu_and_per_tensor_on_a_cpu():
    plan = Layout(precision="bf16")
    host = replace(H100, host_launch_s=40e-6)
    gpu = optimizer_time(plan, host, 124e6, 150, fused=False)
    cpu = optimizer_time(plan, replace(host, kind="cpu", host_launch_s=0.0, op_overhead_s=40e-6), 124e6, 150, fused=False)
    # 124M fp32 parameters × ~84 bytes at the H100's bandwidth: ~3.7 ms; the CPU loop adds 1,512 launches
    assert gpu == pytest.approx(124e6 * 84 / H100.memory_bandwidth_Bps, rel=0.05)
    assert cpu - gpu == pytest.approx((12 + 1500) * 40e-6 - 0.0, rel=0.1)


def _measured_rows() -> list[dict]:
    return json.loads((BENCH / "single_device_h200.json").read_text())["single_device"]


def test_the_h200_calibration_predicts_the_h200_layouts():
    """Measured on one H200 (benchmarks/device_check.sh; the calibration taken in the same call): every layout
    within 20 % and the median within 5 % (RESULTS.md, "On one GPU": host-bound micro-batch 2 over-predicted by
    ~16 %, checkpointing under-predicted by ~10 %, the rest within 2 %)."""
    from shardwise.bench.planner_device import GPT2_SMALL_FLAGS, SINGLE_LAYOUTS
    from shardwise.planner import predict
    from shardwise.runtime.prediction import gpt_spec, plan_from_config

    hw = Hardware.load(BENCH / "hardware_h200_1gpu.json")
    assert hw.kind == "gpu" and hw.host_cores == 0 and "tiny2_s" in hw.block_probe
    flags = dict(SINGLE_LAYOUTS)
    rows = _measured_rows()
    assert {r["layout"] for r in rows} == set(flags)
    errors = []
    for row in rows:
        cfg = _config(GPT2_SMALL_FLAGS.split() + flags[row["layout"]] + ["--parallel.nproc", "1"])
        pred = predict(gpt_spec(cfg), plan_from_config(cfg, train_passes=True), hw, global_batch=cfg.data.global_batch,
                       fused_optimizer=False)  # the stored rows ran torch's unfused AdamW
        assert pred.step_time_s == pytest.approx(row["measured_s"], rel=0.20), row["layout"]
        errors.append(abs(pred.step_time_s / row["measured_s"] - 1))
    assert sorted(errors)[len(errors) // 2] < 0.05


def test_bf16_gemms_are_priced_on_the_bf16_probe():
    """The H200 file: a 16,384 × 3,072 × 768 GEMM reaches 93 % of the fp32 peak but 83 % of the bf16 one, a
    1,024-cube 74 % against 20 %; the fp32 points would price bf16 GEMMs too fast."""
    hw = Hardware.load(BENCH / "hardware_h200_1gpu.json")
    assert hw.gemm_points_bf16 and hw.gemm_points_bf16 != hw.gemm_points
    cpu = Hardware.load(BENCH / "hardware_cpu_2ranks.json")  # CPU ranks: launches added, AdamW per tensor
    assert cpu.kind == "cpu" and cpu.host_cores > 0 and hw.kind == "gpu"
    for shape in ((16384, 3072, 768), (1024, 1024, 1024), (4096, 256, 1024)):
        assert hw.gemm_efficiency(*shape, "bf16") < hw.gemm_efficiency(*shape, "fp32")
    assert hw.gemm_efficiency(1024, 1024, 1024, "bf16") < 0.3
    # a file without bf16 probes (or a preset) keeps one curve for both
    assert H100.gemm_efficiency(4096, 4096, 4096, "bf16") == H100.gemm_efficiency(4096, 4096, 4096)


def _config(argv: list[str]):
    """A ``shardwise train`` config from its flags (no launch)."""
    return load_config(overrides=parse_overrides(argv))


def test_mfu_uses_the_dense_peak_of_the_training_precision(monkeypatch):
    import torch

    from shardwise.runtime.metrics import peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert peak_flops(gpu) == peak_flops(gpu, "fp32") == 66.9e12
    assert peak_flops(gpu, "bf16") == 989e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    assert peak_flops(gpu, "bf16") == 312e12
    assert peak_flops(torch.device("cpu"), "bf16") is None


def test_a_gpu_calibration_sweeps_gemms_big_enough_to_fill_tensor_cores():
    from shardwise.cli.calibrate_probe import gemm_shapes, probe_settings

    cpu, gpu = gemm_shapes(probe_settings(False)), gemm_shapes(probe_settings(False, "cuda"))
    flops = lambda shapes: max(m * n * k for m, n, k in shapes)  # noqa: E731
    assert flops(cpu) < 8192 ** 3 <= flops(gpu)
    assert set(cpu) < set(gpu)  # the CPU's shapes stay, so files stay comparable
    assert max(s[0] * s[1] * s[2] for s in gemm_shapes(probe_settings(True, "cuda"))) >= 8192 ** 3
    # the bandwidth buffer (float32 elements) is past a 60 MB L2 even in the quick sweep
    assert probe_settings(True, "cuda").bandwidth_elements * 4 >= 4 * 60e6
    assert probe_settings(True).bandwidth_elements == 8 << 20  # the CPU's files stay comparable


def test_the_h200_preset_is_the_h100_chip_with_more_and_faster_memory():
    h200, h100 = Hardware.preset("h200-141g-sxm"), Hardware.preset("h100-80g-sxm")
    assert h200.peak_flops == h100.peak_flops and h200.kind == "gpu"
    assert h200.memory_bytes == 141e9 and h200.memory_bandwidth_Bps / h100.memory_bandwidth_Bps == pytest.approx(4.8 / 3.35)


def test_two_tiny_blocks_leave_the_pass_fixed_costs_out_of_the_launch_cost():
    one = with_launch_cost(H100, 1.5e-3, gpu=True)
    two = with_launch_cost(H100, 1.5e-3, gpu=True, tiny2_s=2.4e-3)  # the second block adds 0.9 ms of launches
    assert two.host_launch_s == pytest.approx(one.host_launch_s * 0.9 / 1.5, rel=1e-9)
    # a second block that seems free (noise) falls back to the single block, never to nothing
    assert with_launch_cost(H100, 1.5e-3, gpu=True, tiny2_s=1.4e-3).host_launch_s == one.host_launch_s


def test_a_calibration_file_carries_the_two_block_probe(tmp_path):
    from shardwise.planner.predict import block_factors

    raw = json.loads((BENCH / "hardware_h200_1gpu.json").read_text())
    raw["probe"]["block"].pop("tiny2_s")  # a file from before the two-block probe
    old = tmp_path / "old.json"
    old.write_text(json.dumps(raw))
    raw["probe"]["block"]["tiny2_s"] = raw["probe"]["block"]["tiny_s"] * 1.6
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(raw))
    with_two = block_factors(Hardware.load(path))
    without = block_factors(Hardware.load(old))
    assert with_two.host_launch_s == pytest.approx(without.host_launch_s * 0.6, rel=1e-6)
    raw["probe"]["block"]["tiny2_s"] = "fast"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="tiny2_s"):
        Hardware.load(path)


def test_autocast_scales_the_host_launches_of_bf16_plans_only():
    from shardwise.planner.overhead import autocast_factor

    layer, host_bound = _block(), replace(H100, host_launch_s=50e-6)
    slower = replace(host_bound, autocast_launch_factor=1.4)
    # micro-batch 1 is host-bound: every launch costs 1.4 x under autocast
    assert _total(slower, layer, 1) == pytest.approx(1.4 * _total(host_bound, layer, 1), rel=1e-9)
    fp32 = Layout(micro_batch=1, precision="fp32")
    t = lambda hw: layer_time(layer, fp32, hw, flash=True, tp_per_node=1)  # noqa: E731
    assert t(slower) == t(host_bound)  # no autocast in fp32
    # device-bound work hides the host either way
    assert _total(replace(H100, host_launch_s=1e-6, autocast_launch_factor=1.4), layer, 64) == pytest.approx(
        _total(replace(H100, host_launch_s=1e-6), layer, 64), rel=1e-9)
    assert autocast_factor(1e-3, 1.3e-3) == pytest.approx(1.3) and autocast_factor(1e-3, 0.9e-3) == 1.0
    assert autocast_factor(1e-3, None) == 1.0


def test_a_gpu_calibration_carries_the_autocast_tiny_block(tmp_path):
    from shardwise.planner.predict import block_factors

    raw = json.loads((BENCH / "hardware_h200_1gpu.json").read_text())
    assert block_factors(Hardware.load(BENCH / "hardware_h200_1gpu.json")).autocast_launch_factor == 1.0  # older file
    raw["probe"]["block"]["tiny_ac_s"] = raw["probe"]["block"]["tiny_s"] * 1.25
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(raw))
    assert block_factors(Hardware.load(path)).autocast_launch_factor == pytest.approx(1.25)
    raw["probe"]["block"]["tiny_ac_s"] = -1
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="tiny_ac_s"):
        Hardware.load(path)


def test_the_gpu_quick_probe_prices_bf16_on_its_own_points():
    """The quick probe's construction on a GPU (pure), fed with what the live probe measured on an H200
    (benchmarks/quick_probe_h200.json: three probes, then the six layouts trained on the same machine): bf16's
    peak and points are bf16's (squares and GPT-2-sized shapes), the host launch comes from the two tiny
    blocks, bf16 plans pay the autocast factor, and every probe predicts every layout within 30 % (worst
    27.8 %, the checkpointed one, under-predicted: the quick probe has no recomputation factor, and since the
    attention core is priced as a fused IO-aware kernel on GPUs (``compute.io_aware_attention``) it runs at the
    GEMM efficiency of its per-head products, which SDPA's kernel at head dim 64 does not reach: 18.5 % before)."""
    from shardwise.bench.planner_device import GPT2_SMALL_FLAGS, SINGLE_LAYOUTS
    from shardwise.planner import predict
    from shardwise.runtime.prediction import GPU_SKINNY_GEMMS, gpt_spec, plan_from_config, probed_hardware

    data = json.loads((BENCH / "quick_probe_h200.json").read_text())
    flags = dict(SINGLE_LAYOUTS)
    for run in data["quick_probe_runs"]:
        measured = {k: v for k, v in run.items() if k != "wall_s"}
        measured["rows"] = [tuple(r) for r in measured["rows"]]
        measured["bf16_rows"] = [tuple(r) for r in measured["bf16_rows"]]
        assert {tuple(int(v) for v in r[:3]) for r in measured["bf16_rows"]} >= set(GPU_SKINNY_GEMMS)
        hw = probed_hardware(**measured)
        assert hw.kind == "gpu" and hw.peak_flops["bf16"] > 10 * hw.peak_flops["fp32"]
        assert max(e for *_, e in hw.gemm_points_bf16) == 1.0 and hw.host_launch_s > 0
        assert hw.autocast_launch_factor == pytest.approx(run["block_ac_s"] / run["block_s"])
        for row in data["single_device"]:
            cfg = _config(GPT2_SMALL_FLAGS.split() + flags[row["layout"]] + ["--parallel.nproc", "1"])
            pred = predict(gpt_spec(cfg), plan_from_config(cfg, train_passes=True), hw, global_batch=16,
                           fused_optimizer=False)  # the stored rows ran torch's unfused AdamW
            assert pred.step_time_s == pytest.approx(row["measured_s"], rel=0.30), row["layout"]
    # a CPU probe keeps bf16 at the fp32 rate, no points of its own, launches added per kernel
    cpu = probed_hardware(device="cpu", nproc=2, cores=2, scale=1.0, rows=[(64.0, 1e9), (512.0, 5e10)], bf16_rows=[],
                          bandwidth=2e10, overhead=2e-6, memory=8e9, block_s=1e-2, block2_s=None)
    assert cpu.kind == "cpu" and cpu.peak_flops["bf16"] == cpu.peak_flops["fp32"] and not cpu.gemm_points_bf16
    assert cpu.host_launch_s == 0.0 and cpu.op_overhead_s > 2e-6 and cpu.autocast_launch_factor == 1.0


def test_shardwise_train_is_priced_with_a_fused_adamw_on_gpus_and_torchs_loop_on_cpus():
    from shardwise.models.gpt import GPTConfig
    from shardwise.planner import ModelSpec, predict

    spec = ModelSpec.gpt(GPTConfig.preset("gpt-small"))
    plan = Layout(micro_batch=4)
    gpu = predict(spec, plan, H100, global_batch=4, seq_len=128)
    unfused = predict(spec, plan, H100, global_batch=4, seq_len=128, fused_optimizer=False)
    # optimizer.implementation = auto runs fused AdamW on CUDA: 32 bytes per parameter, not ~84
    assert gpu.step_time_s < unfused.step_time_s
    assert predict(spec, plan, H100, global_batch=4, seq_len=128, fused_optimizer=True).step_time_s == gpu.step_time_s
    cpu = Hardware.load("benchmarks/hardware_cpu_2ranks.json")
    assert (predict(spec, plan, cpu, global_batch=4, seq_len=128).step_time_s
            == predict(spec, plan, cpu, global_batch=4, seq_len=128, fused_optimizer=False).step_time_s)
