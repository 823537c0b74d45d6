"""Memory that tells the truth: the planner's construction-peak term (pure), ``shardwise train``'s refusal of a
layout predicted not to fit (in this process, no rank started), and the summary's process peak next to the bare
runtime it started from."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch.nn as nn

from shardwise import cli
from shardwise.planner import Hardware, ModelSpec, Layout, predict
from shardwise.planner.layers import Gemm, Layer
from shardwise.planner.memory import construction_bytes, largest_tensor, model_state_bytes
from shardwise.runtime.config import load_config, validate
from shardwise.runtime.memory_check import check_memory, memory_refusal
from shardwise.runtime.metrics import _comparison_rows, _peak_row, summary_record

A100 = Hardware.preset("a100-80g-sxm")
# a GPT whose vocabulary table dwarfs its blocks: one full copy of it in flight is most of what a rank builds
BIG_VOCAB = ModelSpec.gpt(n_layer=2, n_embd=1024, n_head=8, vocab_size=262144, seq_len=128, block_size=128)
BIG_MODEL = ["--model.n_layer", "64", "--model.n_embd", "8192"]  # ~52 B parameters: fits no CPU host or GPU
BIG_FIELDS = [f.removeprefix("--") for f in BIG_MODEL]


def _pred(spec: ModelSpec, **plan: object):
    p = Layout(**{"micro_batch": 1, "precision": "fp32", **plan})  # type: ignore[arg-type]
    return predict(spec, p, A100, global_batch=p.dp * p.micro_batch)


def test_largest_tensor_is_the_builders_else_the_largest_weight_gemm_else_the_layer():
    assert largest_tensor(Layer("x", "block", params=10, largest=7)) == 7
    gemms = (Gemm("a", 4, 3, 5), Gemm("b", 4, 6, 2), Gemm("core", 4, 100, 100, weight=False))
    assert largest_tensor(Layer("x", "block", params=1000, gemms=gemms)) == 15
    assert largest_tensor(Layer("x", "other", params=42)) == 42
    v, h = 262144, 1024
    assert [largest_tensor(layer) for layer in BIG_VOCAB.layers] == [v * h, 4 * h * h, 4 * h * h, v * h]
    llama = ModelSpec.llama(n_layer=1, hidden=64, heads=4, kv_heads=2, ffn=176, vocab_size=1000, seq_len=16)
    assert [largest_tensor(layer) for layer in llama.layers] == [1000 * 64, 176 * 64, 1000 * 64]


def test_a_traced_layer_knows_its_largest_parameter():
    import torch

    model = nn.Sequential(nn.Linear(8, 32), nn.Sequential(nn.Linear(32, 4), nn.Linear(4, 4)), nn.Linear(4, 2))
    spec = ModelSpec.trace(model, (torch.zeros(2, 8),))
    assert max(layer.largest for layer in spec.layers) == 8 * 32


def test_construction_bytes_are_the_kept_parameters_plus_one_tensor_in_flight():
    assert construction_bytes(1000.0, in_flight=10, precision="fp32") == 1040.0
    assert construction_bytes(1000.0, in_flight=10, precision="bf16-mixed") == 1020.0
    assert construction_bytes(1000.0, in_flight=0, precision="fp32") == 1000.0


def test_a_replicating_layout_builds_the_whole_model_in_place():
    one = _pred(BIG_VOCAB, dp=1).memory
    assert one.construction == pytest.approx(4 * BIG_VOCAB.params)  # every tensor whole, nothing in flight
    assert one.construction == one.params
    # data parallelism allocates its gradient buckets (every gradient, as views) when it wraps the model
    dp = _pred(BIG_VOCAB, dp=4).memory
    assert dp.construction == pytest.approx(8 * BIG_VOCAB.params) and dp.grads == pytest.approx(4 * BIG_VOCAB.params)
    zero2 = _pred(BIG_VOCAB, dp=4, zero_stage=2).memory  # whole parameters; the gradient shards come in backward
    assert zero2.construction == pytest.approx(zero2.params)
    assert zero2.params == pytest.approx(4 * BIG_VOCAB.params)


def test_zero3_keeps_its_shards_and_reads_no_tensor_whole():
    mem = _pred(BIG_VOCAB, dp=4, zero_stage=3).memory
    states = model_state_bytes(BIG_VOCAB.params, precision="fp32", zero_stage=3, dp=4)
    assert mem.params == pytest.approx(states.params)
    assert mem.construction == pytest.approx(states.params)  # flat ranges read directly; gradients come later


def test_tensor_parallelism_builds_the_largest_split_tensor_whole():
    mem = _pred(BIG_VOCAB, tp=8).memory
    assert mem.construction == pytest.approx(mem.params + 4 * 262144 * 1024)
    pipeline = _pred(BIG_VOCAB, pp=2).memory  # a stage keeps its tensors whole: nothing in flight
    assert pipeline.construction == pytest.approx(pipeline.params)


def test_the_predicted_peak_is_the_larger_of_construction_and_training():
    mem = _pred(BIG_VOCAB, tp=8).memory  # 1/8 of the states kept, a whole vocabulary table in flight
    assert mem.construction > mem.training and mem.total == mem.construction and mem.largest == "construction"
    assert mem.to_json()["construction"] == mem.construction and mem.to_json()["training_bytes"] == mem.training
    plain = _pred(BIG_VOCAB, dp=1).memory  # states 16 B per parameter against 4 B built: training is the peak
    assert plain.total == plain.training > plain.construction and plain.largest != "construction"
    tight = dataclasses.replace(A100, memory_bytes=(mem.training + mem.total) / 2)
    pred = predict(BIG_VOCAB, Layout(tp=8, micro_batch=1, precision="fp32"), tight, global_batch=1)
    assert not pred.fits  # fits training, not construction


def _cfg(*flags: str):
    it = iter(flags)
    return validate(load_config(overrides=dict(zip(it, it))))


def test_the_refusal_names_the_layout_both_sizes_and_the_fix():
    from shardwise.runtime.prediction import gpt_spec, plan_from_config

    cfg = _cfg(*BIG_FIELDS, "parallel.nproc", "2")
    assert memory_refusal(_pred(BIG_VOCAB, dp=1), cfg, device="cpu", nproc=2) is None  # that one fits an A100
    big = predict(gpt_spec(cfg), plan_from_config(cfg, train_passes=True), A100, global_batch=cfg.data.global_batch)
    line = memory_refusal(big, cfg, device="cpu", nproc=2)
    assert line is not None and "\n" not in line
    for part in ("layout dp=2 tp=1", "per rank at its peak", "largest term: optimizer", "shared by 2 ranks",
                 "--parallel.zero_stage 3", "--parallel.auto true", "--train.memory_check false"):
        assert part in line, (part, line)


def test_the_check_is_skipped_when_turned_off_or_when_auto_searched():
    check_memory(_cfg(*BIG_FIELDS, "train.memory_check", "false"), device="cpu", nproc=2)  # no error
    auto = dataclasses.replace(_cfg(*BIG_FIELDS), parallel=dataclasses.replace(_cfg(*BIG_FIELDS).parallel, auto=True))
    check_memory(auto, device="cpu", nproc=2)  # the search kept only layouts that fit
    with pytest.raises(ValueError, match="--train.memory_check false launches it anyway"):
        check_memory(_cfg(*BIG_FIELDS), device="cpu", nproc=2)


def test_train_with_the_check_off_goes_on_to_launch(tmp_path, monkeypatch, capsys):
    from shardwise.cli import train

    monkeypatch.chdir(tmp_path)
    launched = []
    monkeypatch.setattr(train, "run_job", lambda *a, **k: launched.append(a) or 1)
    assert cli.main(["train", *BIG_MODEL]) == 2 and not launched
    assert "--train.memory_check false launches it anyway" in capsys.readouterr().err
    assert cli.main(["train", *BIG_MODEL, "--train.memory_check", "false"]) == 1 and len(launched) == 1


def _ranks(run_dir: Path, device: str = "cpu") -> None:
    (run_dir / "ranks").mkdir()
    for rank in (0, 1):
        memory = {"params": 100, "grads": 100, "optimizer": 200, "peak": 400}
        (run_dir / "ranks" / f"rank{rank:05d}.json").write_text(json.dumps(
            {"rank": rank, "final_loss": 2.0, "steps": 6, "step_s": 0.5, "device": device, "memory": memory,
             "peak_memory": 3000 + rank, "bare_runtime_bytes": 1000}))


def test_the_summary_has_the_process_peak_and_the_bare_runtime(tmp_path):
    _ranks(tmp_path)
    predicted = {"step_time_s": 0.25, "peak_memory_bytes": 1900, "model_state_bytes": 380, "construction_bytes": 120,
                 "hardware_source": "x"}
    record = summary_record(_cfg("parallel.nproc", "2", "train.steps", "6"), tmp_path, predicted)
    assert record["measured_process_peak_bytes"] == [3000, 3001] and record["bare_runtime_bytes"] == [1000, 1000]
    assert record["predicted_construction_bytes"] == 120
    assert record["measured_peak_memory_bytes"] == [400, 400]  # the strategy's model-state peak, unchanged
    rows = dict(_comparison_rows(record))
    assert "construction 120 B" in rows["peak vs prediction"] and "r0 2.0 KiB, r1 2.0 KiB" in rows["peak vs prediction"]
    ranks = [json.loads(p.read_text()) for p in sorted((tmp_path / "ranks").iterdir())]
    label, value = _peak_row(ranks)
    assert label == "peak resident per rank (incl. construction)"
    assert value.startswith("r0 2.9 KiB (bare runtime 1000 B, +2.0 KiB), r1 2.9 KiB")


def test_the_resident_peak_is_this_programs_own_not_the_launchers():
    import subprocess
    import sys

    from shardwise.runtime.metrics import resident_peak_bytes

    block = bytearray(256 << 20)
    block[::4096] = b"\1" * len(block[::4096])  # touch every page
    assert resident_peak_bytes() >= 256 << 20
    # a child started while this process holds the block: ru_maxrss inherits our resident set, VmHWM does not
    code = ("import resource; from shardwise.runtime.metrics import resident_peak_bytes as r; "
            "print(r(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    own, inherited = map(int, subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                             check=True).stdout.split())
    del block
    if sys.platform.startswith("linux"):
        assert own < inherited and own > 0


def test_the_optimizer_sets_the_state_bytes():
    n = 1000.0
    assert model_state_bytes(n, precision="fp32", zero_stage=0, dp=1).optimizer == 8000  # AdamW: m and v
    assert model_state_bytes(n, precision="fp32", zero_stage=0, dp=1, optimizer="sgd").optimizer == 0
    assert model_state_bytes(n, precision="fp32", zero_stage=1, dp=4, optimizer="sgd-momentum").optimizer == 1000
    assert model_state_bytes(n, precision="bf16-mixed", zero_stage=0, dp=1, optimizer="sgd").optimizer == 4000  # master


def test_released_gradients_and_activations_peak_apart_only_without_accumulation():
    psi = sum(layer.params for layer in BIG_VOCAB.layers)
    one = _pred(BIG_VOCAB, dp=4, zero_stage=3).memory  # ZeRO-3, one pass: the smaller of the two is not added
    assert one.apart == pytest.approx(min(one.activations, 4 * psi / 4)) and one.apart > 0
    assert one.training == pytest.approx(one.params + one.grads + one.optimizer + one.activations + one.buffers
                                         - one.apart)
    two = predict(BIG_VOCAB, Layout(dp=4, zero_stage=3, micro_batch=1, grad_accum=2), A100, global_batch=8).memory
    assert two.apart == 0  # the first pass's gradient shards wait through the second forward
    assert _pred(BIG_VOCAB, dp=4, zero_stage=1).memory.apart == 0  # ZeRO-1's persistent buffers
    assert _pred(BIG_VOCAB, dp=1).memory.apart > 0  # one rank, no buckets: autograd's gradients


def test_a_cpu_rank_adds_its_runtime_growth_and_a_gpu_does_not():
    from shardwise.planner.memory import CPU_RUNTIME_BYTES

    cpu = dataclasses.replace(A100, kind="cpu")
    p = Layout(dp=4, zero_stage=3, micro_batch=1)
    on_cpu, on_gpu = (predict(BIG_VOCAB, p, hw, global_batch=4).memory for hw in (cpu, A100))
    assert on_gpu.runtime == 0 and on_cpu.runtime == CPU_RUNTIME_BYTES
    assert on_cpu.training - on_gpu.training == pytest.approx(CPU_RUNTIME_BYTES)
