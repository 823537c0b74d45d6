"""``shardwise predict`` in this process (no ranks), ``plan_from_config``, the hardware it resolves, and the
records ``shardwise train`` writes around a run (prediction before, predicted vs measured after)."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from shardwise import cli
from shardwise.comm.calibration import AlphaBeta, Calibration
from shardwise.runtime.config import load_config, validate
from shardwise.runtime.metrics import append_record, read_metrics, summary_record
from shardwise.runtime.prediction import plan_from_config, quick_probe_hardware, resolve_hardware

GPT3 = ["--model.n_layer", "96", "--model.n_embd", "12288", "--model.n_head", "96", "--model.vocab_size", "51200",
        "--model.block_size", "2048"]
EXAMPLE = ["predict", *GPT3, "--parallel.nproc", "1024", "--parallel.tp", "8", "--parallel.pp", "8",
           "--parallel.pp_schedule", "interleaved", "--parallel.pp_chunks", "2", "--parallel.micro_batch", "1",
           "--data.global_batch", "1536", "--parallel.activation_checkpointing", "true", "--train.precision", "bf16",
           "--hardware", "a100-80g-sxm", "--devices-per-node", "8", "--json"]
TOO_BIG = ["predict", *GPT3, "--parallel.nproc", "8", "--parallel.tp", "8", "--parallel.micro_batch", "1",
           "--data.global_batch", "8", "--train.precision", "bf16", "--hardware", "a100-80g-sxm"]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:  # argparse's usage errors
        rc = int(exc.code or 0)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(autouse=True)
def no_local_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty cache: no calibration of this machine unless a test writes one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_issue_example_is_one_json_object(capsys):
    rc, out, err = run(EXAMPLE, capsys)
    assert rc == 0, err
    data = json.loads(out)  # the whole of stdout is one object
    for key in ("step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "fits", "memory", "breakdown", "dominant",
                "plan", "stages", "hardware", "model", "devices", "global_batch", "seq_len"):
        assert key in data, key
    assert data["fits"] is True and 100 < data["tflops_per_device"] < 200
    assert (data["devices"], data["global_batch"], data["seq_len"]) == (1024, 1536, 2048)
    plan = data["plan"]  # Megatron's reading: micro_batch is one pipeline micro-batch, all 96 in one flush
    assert (plan["dp"], plan["micro_batch"], plan["microbatches"], plan["grad_accum"]) == (16, 1, 96, 1)
    assert plan["precision"] == "bf16" and plan["activation_checkpointing"] == "full"
    assert len(data["stages"]) == 16 and data["memory"]["largest"] in data["memory"]
    assert data["step_time_s"] == pytest.approx(sum(data["breakdown"].values()))


def test_a_plan_that_does_not_fit_is_not_an_error(capsys):
    rc, out, err = run([*TOO_BIG, "--json"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert data["fits"] is False and data["memory"]["largest"] == "optimizer"
    assert data["memory"]["total_bytes"] > data["memory"]["capacity_bytes"]
    rc, out, err = run(TOO_BIG, capsys)  # the table names the largest term
    assert rc == 0 and "NO:" in out and "largest term: optimizer" in out and "← largest" in out
    for word in ("step time", "tokens/s", "TF/s per device", "MFU", "activations", "pipeline_bubble", "W ms"):
        assert word in out, word


@pytest.mark.parametrize("argv,expected", [
    (["--parallel.nproc", "2", "--hardware", "a100-80g"], ("unknown hardware 'a100-80g'", "did you mean 'a100-80g-sxm'")),
    (["--parallel.nproc", "2", "--hardware", "missing.json"], ("'missing.json' does not exist", "shardwise calibrate")),
    (["--parallel.nproc", "2", "--parallel.calibration", "missing.json"],  # no --hardware: train's file, named
     ("'missing.json' does not exist", "shardwise calibrate")),
    (["--parallel.nproc", "3", "--parallel.tp", "3", "--hardware", "a100-80g-sxm"],
     ("parallel.tp = 3 must divide model.n_head = 2", "use a tp from [1, 2]")),
    (["--parallel.nproc", "2", "--data.global_batch", "30", "--parallel.micro_batch", "16", "--hardware",
      "a100-80g-sxm"],
     ("global_batch=30 is not a multiple of micro_batch × dp = 16 × 2 = 32", "use global_batch=32")),
    (["--parallel.nproc", "4", "--parallel.pp", "2", "--parallel.micro_batch", "1", "--data.global_batch", "6",
      "--parallel.pp_schedule", "interleaved", "--parallel.pp_chunks", "2", "--hardware", "a100-80g-sxm"],
     ("micro-batches per flush (3) to be a multiple of pp = 2", "multiple of dp × micro_batch × pp = 4")),
    (["--hardware", "a100-80g-sxm"], ("parallel.nproc = 0", "--parallel.nproc 8")),
    (["--parallel.nproc", "2", "--hardware", "a100-80g-sxm", "--devices-per-node", "0"], ("--devices-per-node 0",)),
])
def test_bad_input_is_one_line_exit_2_nothing_on_stdout(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = run(["predict", *argv, "--json"], capsys)
    line = err.strip()
    assert rc == 2 and out == "", (rc, out, err)
    assert "\n" not in line and line.startswith("shardwise predict: error: "), err
    for part in expected:
        assert part in line, (part, line)


def _calibration_file(path: Path, nproc: int) -> None:
    cal = Calibration(world_size=nproc, backend="gloo", device="cpu",
                      models={"all_reduce": {"native": AlphaBeta(300.0, 2e-3)}})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "format": "shardwise-hardware/1", "name": "local-cpu-2", "device": "cpu", "backend": "gloo",
        "devices_per_node": nproc, "memory_bytes": 4 << 30, "machine": {"host": "h", "cpus": 2},
        "probe": {"gemm": {"float32": [[64, 64, 64, 1e9], [512, 512, 512, 3e10]]}, "memory_bandwidth_Bps": 1e10,
                  "op_overhead_s": 5e-6},
        "collectives": {str(nproc): cal.to_json()}}))


def test_the_default_hardware_is_this_machines_calibration(capsys, no_local_calibration):
    from shardwise.comm.hardware import default_calibration_path

    path = default_calibration_path("cpu", 2)
    assert str(path).startswith(str(no_local_calibration))
    _calibration_file(path, 2)
    rc, out, err = run(["predict", "--parallel.nproc", "2", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(out)["hardware"] == "local-cpu-2"


def _cfg(*, launch: bool = True, **flags: str):
    return validate(load_config(overrides=flags), launch=launch)


def test_plan_from_config_fields():
    plan = plan_from_config(_cfg(**{"parallel.nproc": "4", "parallel.micro_batch": "4", "data.global_batch": "32"}))
    assert (plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.grad_accum) == (4, 1, 1, 4, 2)  # dp inferred
    plan = plan_from_config(_cfg(**{"parallel.nproc": "4", "parallel.tp": "2", "parallel.micro_batch": "4",
                                    "parallel.activation_checkpointing": "true", "train.precision": "bf16"}))
    assert (plan.dp, plan.tp, plan.activation_checkpointing, plan.precision) == (2, 2, "full", "bf16")
    assert plan.zero_stage == 0 and plan.sequence_parallel is False
    plan = plan_from_config(_cfg(**{"parallel.nproc": "2", "parallel.zero_stage": "3"}))
    assert (plan.zero_stage, plan.precision, plan.activation_checkpointing) == (3, "fp32", "none")


def test_plan_from_config_pipeline_readings():
    flags = {"parallel.nproc": "4", "parallel.pp": "2", "parallel.micro_batch": "8", "data.global_batch": "32"}
    # shardwise train: 8 sequences per pass of a replica, cut into pp_microbatches = 4 micro-batches of 2
    trained = _cfg(**flags)
    assert trained.parallel.pp_microbatches == 4 and trained.parallel.grad_accum == 2
    plan = plan_from_config(trained, train_passes=True)
    assert (plan.dp, plan.micro_batch, plan.microbatches, plan.grad_accum) == (2, 2, 4, 2)
    assert plan.resolved(32).microbatches == 4  # dp × accum × micro_batch × microbatches = 2 × 2 × 2 × 4
    # shardwise predict (Megatron): micro_batch is one micro-batch; pp_microbatches 0 → one flush per step
    plan = plan_from_config(_cfg(launch=False, **flags))
    assert (plan.micro_batch, plan.microbatches, plan.grad_accum) == (8, 0, 0)
    assert (plan.resolved(32).microbatches, plan.resolved(32).grad_accum) == (2, 1)
    plan = plan_from_config(_cfg(launch=False, **flags, **{"parallel.pp_microbatches": "1"}))
    assert (plan.resolved(32).microbatches, plan.resolved(32).grad_accum) == (1, 2)
    # interleaved with micro_batch < pp: refused by train's pass cutting, fine in Megatron's reading
    inter = {"parallel.nproc": "4", "parallel.pp": "4", "parallel.pp_schedule": "interleaved", "parallel.pp_chunks": "2",
             "parallel.micro_batch": "1", "data.global_batch": "8", "model.n_layer": "8"}
    with pytest.raises(ValueError, match="cannot be cut into 4 equal parts"):
        _cfg(**inter)
    assert plan_from_config(_cfg(launch=False, **inter)).resolved(8).microbatches == 8


def test_plan_errors_name_the_config_key():
    cfg = _cfg(launch=False, **{"parallel.nproc": "2"})
    bad = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=2, dp=1, pp_schedule="interleaved"))
    with pytest.raises(ValueError, match="parallel.pp_schedule 'interleaved' needs chunks >= 2"):
        plan_from_config(bad)


def test_resolve_hardware_and_the_quick_probe():
    assert resolve_hardware("h100-80g-sxm", device="cpu", nproc=8, devices_per_node=4).devices_per_node == 4
    start = time.perf_counter()
    hw = quick_probe_hardware(2)
    assert time.perf_counter() - start < 2.0  # < 1 s on an idle machine; a loaded CI box gets slack
    assert hw.peak_flops["fp32"] > 0 and hw.memory_bandwidth_Bps > 0 and hw.devices_per_node == 2
    assert max(e for _, e in hw.gemm_curve) == pytest.approx(1.0)
    assert hw.intra.bus_bandwidth_Bps == pytest.approx(0.87e9)
    # more ranks than cores share them: each rank gets less
    many = quick_probe_hardware(64)
    assert many.peak_flops["fp32"] < hw.peak_flops["fp32"]
    # the per-launch overhead comes from a block trained in eager mode, not from a bare add: microseconds
    assert 1e-7 < hw.op_overhead_s < 1e-2


def test_the_quick_probe_takes_its_launch_overhead_from_the_tiny_block(monkeypatch):
    from shardwise.runtime import prediction

    # a tiny block that takes 2 ms (sleep: never less) makes every launch cost tens of microseconds; one that
    # takes nothing leaves the bare op's microseconds
    monkeypatch.setattr(prediction, "tiny_block_step", lambda dev: (lambda: time.sleep(0.002)))
    assert quick_probe_hardware(2).op_overhead_s > 3e-5
    monkeypatch.setattr(prediction, "tiny_block_step", lambda dev: (lambda: None))
    assert quick_probe_hardware(2).op_overhead_s < 1e-5


def test_launch_overhead_recovers_the_overhead_that_explains_the_block():
    from dataclasses import replace

    from shardwise.planner import Hardware, Layout
    from shardwise.planner.compute import layer_time
    from shardwise.planner.spec import gpt_layers
    from shardwise.planner.overhead import TINY_BLOCK, launch_overhead

    hw = replace(Hardware.preset("a100-80g-sxm"), op_overhead_s=0.0)
    t = TINY_BLOCK
    layer = gpt_layers(n_layer=1, h=t["n_embd"], a=t["n_head"], v=8, s=t["seq"], positions=t["seq"], tie=True,
                       bias=True, dropout=False, attention="flash")[1]
    for o in (2e-6, 15e-6):  # a block that really costs this per launch is read back as this
        lt = layer_time(layer, Layout(micro_batch=t["batch"]), replace(hw, op_overhead_s=o), flash=True, tp_per_node=1)
        assert launch_overhead(hw, lt.F + lt.B + lt.W) == pytest.approx(o, rel=1e-6)
    assert launch_overhead(hw, 0.0) == 0.0  # faster than its arithmetic: no overhead, never negative


def test_train_writes_the_prediction_record_and_survives_a_failed_one(tmp_path, monkeypatch, capsys):
    from shardwise.cli import train
    from shardwise.runtime import prediction
    from shardwise.runtime.job import Nodes

    cfg = _cfg(**{"parallel.nproc": "2", "train.steps": "5"})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "loss": 1.0}) + "\n")  # a stale failed run
    record = train._prediction(cfg, run_dir, None, Nodes())
    out = capsys.readouterr().out
    assert out.startswith("shardwise train: predicted ") and "per rank" in out and out.count("\n") == 1
    rows = read_metrics(run_dir / "metrics.jsonl", kind=None)
    assert rows == [record] and record["kind"] == "prediction" and record["step"] == 0
    assert record["step_time_s"] > 0 and record["peak_memory_bytes"] >= record["model_state_bytes"] > 0
    assert read_metrics(run_dir / "metrics.jsonl") == []  # the step records' reader skips it

    def broken(*args, **kwargs):
        raise RuntimeError("no planner today\nsecond line")
    monkeypatch.setattr(prediction, "predict_launch", broken)
    assert train._prediction(cfg, run_dir, None, Nodes()) is None
    captured = capsys.readouterr()
    assert captured.err == "shardwise train: prediction skipped: RuntimeError: no planner today\n"


def test_summary_record_puts_measured_next_to_predicted(tmp_path):
    cfg = _cfg(**{"parallel.nproc": "2", "train.steps": "6"})
    (tmp_path / "ranks").mkdir()
    for rank in (0, 1):
        memory = {"params": 100, "grads": 100, "optimizer": 200, "peak": 400}
        (tmp_path / "ranks" / f"rank{rank:05d}.json").write_text(json.dumps(
            {"rank": rank, "final_loss": 2.0, "steps": 6, "step_s": 0.5, "device": "cpu", "memory": memory}))
    predicted = {"step_time_s": 0.25, "peak_memory_bytes": 1000, "model_state_bytes": 380, "hardware_source": "x"}
    record = summary_record(cfg, tmp_path, predicted)
    assert record["kind"] == "summary" and record["step"] == 6
    assert (record["predicted_step_s"], record["measured_step_s"]) == (0.25, 0.5)
    assert record["measured_model_state_bytes"] == [400, 400] and record["measured_peak_memory_bytes"] == [400, 400]
    assert record["predicted_model_state_bytes"] == 380
    append_record(tmp_path, record)
    assert read_metrics(tmp_path / "metrics.jsonl", kind="summary") == [record]
    assert summary_record(cfg, tmp_path, None)["predicted_step_s"] is None


@pytest.mark.parametrize("nproc, threads, scale", [(1, 2, 1.0), (2, 1, 1.0), (4, 1, 0.5)])
def test_the_cpu_quick_probe_times_a_rank_on_its_own_threads(monkeypatch, nproc, threads, scale):
    # on 2 cores a lone rank computes with both (torchrun's default for one process), two ranks with one each,
    # and four ranks get half a core each: timed on one thread, then scaled
    import os

    import torch

    from shardwise.runtime import prediction

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    calls = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n))[1])
    before = torch.get_num_threads()
    got = prediction.quick_probe_measurements(nproc)
    assert calls[0] == threads and calls[-1] == before  # the probe's threads, then the caller's back
    assert got["scale"] == scale and got["cores"] == 2 and got["bandwidth"] > 0
