"""The error band of a prediction (``shardwise.planner.error_band``): which rows judge a hardware and a layout, the
sentence it prints, ties between layouts the model cannot tell apart, and what ``shardwise predict`` / ``plan`` and
``--parallel.auto`` make of them. Pure; the commands run in this process."""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path

import pytest

from shardwise.planner import PRESETS, ErrorBand, Hardware, Layout, ModelSpec, error_band, predict, recommend, ties
from shardwise.planner.error_band import (ANY_LAYOUT, BANDS, FAMILIES, HARDWARE_CLASSES, hardware_class,
                                          layout_family, ranked, tie_tolerance, tied)
from shardwise.planner.search import TIE, simplicity

from .test_predict_cli import run  # cli.main in this process: (exit code, stdout, stderr)

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
A100 = Hardware.preset("a100-80g-sxm")
mod = importlib.import_module("shardwise.planner.error_band")  # the module (the package's name is the function)


@pytest.fixture(autouse=True)
def no_local_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _probe(device: str) -> Hardware:
    from shardwise.runtime.prediction import probed_hardware

    bf16 = [(1024.0, 1024.0, 1024.0, 5e14), (4096.0, 4096.0, 4096.0, 8e14)] if device == "cuda" else []
    return probed_hardware(device=device, nproc=1, cores=2, scale=1.0, rows=[(64.0, 1e9), (512.0, 5e10)],
                           bf16_rows=bf16, bandwidth=2e10, overhead=2e-6, memory=8e9, block_s=1e-2, block2_s=None)


def test_each_hardware_is_judged_by_its_own_class():
    assert hardware_class(A100) == "A100"
    assert hardware_class(Hardware.preset("A100-80G-SXM", devices_per_node=4)) == "A100"  # still a spec sheet
    assert hardware_class(PRESETS["h100-80g-sxm"]) == hardware_class(PRESETS["h200-141g-sxm"]) == "H100/H200"
    # an uncalibrated GPU of the user's own description is priced like the H100 preset
    mine = dataclasses.replace(A100, name="mine", peak_flops={"fp32": 1e13, "bf16": 2e14})
    assert hardware_class(mine) == "H100/H200"
    assert hardware_class(Hardware.load(BENCH / "hardware_h200_1gpu.json")) == "calibrated GPU"
    assert hardware_class(Hardware.load(BENCH / "hardware_cpu_2ranks.json")) == "calibrated CPU"
    assert hardware_class(_probe("cuda")) == "probed GPU"
    assert hardware_class(_probe("cpu")) == "calibrated CPU"
    assert set(HARDWARE_CLASSES) == {cls for cls, _ in BANDS}  # every class has rows


@pytest.mark.parametrize("plan,family", [
    (Layout(dp=8), "data parallel / ZeRO"),
    (Layout(dp=8, zero_stage=3), "data parallel / ZeRO"),
    (Layout(dp=4, tp=2), "tensor parallel"),
    (Layout(dp=2, tp=2, pp=2, microbatches=4), "pipeline"),
    (Layout(pp=2, microbatches=4), "pipeline"),
    (Layout(dp=2, cp=2, pp=2, tp=2, microbatches=4), "context parallel"),  # cp first
    (Layout(dp=4, ep=4, pp=2, microbatches=4), "experts"),  # then experts, before the pipeline
])
def test_layout_families_in_their_order_of_precedence(plan: Layout, family: str):
    assert layout_family(plan) == family and family in FAMILIES


def test_a_band_falls_back_to_its_class_then_to_nothing(monkeypatch: pytest.MonkeyPatch):
    gpu = Hardware.load(BENCH / "hardware_h200_1gpu.json")
    assert ("calibrated GPU", "pipeline") not in BANDS  # our GPU measurements are single-device
    band = error_band(gpu, Layout(pp=2, microbatches=4))
    assert band is not None and band.family == ANY_LAYOUT and band.hardware == "calibrated GPU"
    typical, worst, rows, tables = BANDS[("calibrated GPU", ANY_LAYOUT)]
    assert (band.typical, band.worst, band.rows, band.tables) == (typical, worst, rows, tables)
    own = error_band(A100, Layout(dp=2, pp=4, microbatches=8))
    assert own is not None and (own.hardware, own.family) == ("A100", "pipeline") and own.worst >= own.typical
    monkeypatch.setattr(mod, "BANDS", {k: v for k, v in BANDS.items() if k[0] != "A100"})
    assert error_band(A100, Layout(dp=2)) is None
    assert tie_tolerance(A100, Layout(dp=2)) == TIE  # no band: the search's own resolution


def test_a_family_of_fewer_than_three_rows_is_quoted_its_classs_band(monkeypatch: pytest.MonkeyPatch):
    h100 = Hardware.preset("h100-80g-sxm")
    bands = {("H100/H200", "data parallel / ZeRO"): (0.30, 0.30, 2, "t"),
             ("H100/H200", "pipeline"): (0.05, 0.09, 3, "t"), ("H100/H200", ANY_LAYOUT): (0.10, 0.30, 5, "t")}
    monkeypatch.setattr(mod, "BANDS", bands)
    assert mod.MIN_ROWS == 3
    dp = error_band(h100, Layout(dp=8))
    assert dp is not None and (dp.family, dp.typical, dp.rows) == (ANY_LAYOUT, 0.10, 5)
    pp = error_band(h100, Layout(dp=2, pp=4, microbatches=8))
    assert pp is not None and (pp.family, pp.typical, pp.rows) == ("pipeline", 0.05, 3)


def test_describe_says_the_time_the_spread_and_where_it_comes_from():
    band = ErrorBand(0.08, 0.15, 12, "A100", "pipeline", "megatron-table1, korthikanti-table5", held_out=True)
    assert band.describe(1.4321) == ("1.43 s, typically within ±8.0 % (worst ±15 %, 12 held-out rows of published "
                                      "A100 pipelines: megatron-table1, korthikanti-table5)")
    one = ErrorBand(0.018, 0.158, 1, "calibrated GPU", ANY_LAYOUT, "h200-calibrated")
    assert one.describe(0.25) == ("0.25 s, typically within ±1.8 % (worst ±16 %, 1 in-sample row of measured "
                                  "calibrated GPU layouts of any family: h200-calibrated)")
    assert one.short() == "±1.8 %" and json.loads(json.dumps(one.to_json()))["rows"] == 1


def _pair() -> tuple:
    """Two real predictions of one small model on 2 A100s: ``simple`` (plain data parallel, micro-batch 1) and
    ``busy`` (ZeRO-1, micro-batch 8, so fewer and larger kernels: faster, with more machinery)."""
    spec = ModelSpec.gpt(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, seq_len=128, block_size=128)
    simple = predict(spec, Layout(dp=2, micro_batch=1, grad_accum=8), A100, global_batch=16)
    busy = predict(spec, Layout(dp=2, zero_stage=1, micro_batch=8, grad_accum=1), A100, global_batch=16)
    return simple, busy


def _with_typical(monkeypatch: pytest.MonkeyPatch, typical: float) -> None:
    """Every A100 band (each family and the fallback) with this typical error."""
    patched = {k: (typical, max(typical, 0.5), 3, "test") if k[0] == "A100" else v for k, v in BANDS.items()}
    monkeypatch.setattr(mod, "BANDS", patched)


def test_two_layouts_inside_the_band_tie_and_the_simpler_is_recommended(monkeypatch: pytest.MonkeyPatch):
    simple, busy = _pair()
    assert simplicity(simple.plan) < simplicity(busy.plan)
    gap = simple.step_time_s / busy.step_time_s - 1  # the busy plan is faster by this fraction of its time
    assert gap > 4 * TIE, gap  # a real difference, above the search's own resolution
    _with_typical(monkeypatch, 1.5 * gap)  # the band is wider than the difference: a tie
    assert tied(simple, busy, A100) and tied(busy, simple, A100)
    assert [len(g) for g in ties([busy, simple], A100)] == [2]
    assert recommend([busy, simple], A100) is simple and ranked([busy, simple], A100) == [1, 0]
    _with_typical(monkeypatch, 0.5 * gap)  # narrower: the faster one wins
    assert not tied(simple, busy, A100)
    assert [[p is busy for p in g] for g in ties([simple, busy], A100)] == [[True], [False]]
    assert recommend([simple, busy], A100) is busy and ranked([simple, busy], A100) == [1, 0]


def test_recommend_needs_a_prediction():
    with pytest.raises(ValueError, match="recommend needs at least one prediction"):
        recommend([], A100)


def test_predict_prints_the_step_time_with_its_band(capsys):
    argv = ["predict", "--preset", "gpt-small", "--parallel.nproc", "8", "--parallel.tp", "2", "--parallel.pp", "2",
            "--hardware", "h100-80g-sxm"]
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    text = " ".join(out.split())  # the table wraps the sentence
    assert "typically within ±" in text and "published H100/H200 pipelines" in text
    rc, out, err = run([*argv, "--json"], capsys)
    band = json.loads(out)["error_band"]
    assert rc == 0 and (band["hardware"], band["family"]) == ("H100/H200", "pipeline")
    assert band["typical"] == BANDS[("H100/H200", "pipeline")][0]


def test_plan_marks_ties_and_runs_the_simpler_layout(monkeypatch: pytest.MonkeyPatch, capsys):
    argv = ["plan", "--preset", "gpt-small", "--parallel.nproc", "8", "--hardware", "a100-80g-sxm", "--top", "3"]
    _with_typical(monkeypatch, 0.5)  # every plan within 50 % of the fastest ties
    rc, out, err = run([*argv, "--json"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    plans, best = data["plans"], data["plans"][data["recommended"]]
    assert all(p["error_band"]["typical"] == 0.5 and p["error_band"]["hardware"] == "A100" for p in plans)
    fastest = min(plans, key=lambda p: p["prediction"]["step_time_s"])
    tied_ = [Layout.from_json(p["planner_plan"]) for p in plans if p["tie"]]
    assert fastest["tie"] and best["tie"] and len(tied_) >= 2
    assert simplicity(Layout.from_json(best["planner_plan"])) == min(simplicity(p) for p in tied_)
    rc, out, err = run(argv, capsys)
    assert rc == 0, err
    command = next(ln for ln in out.splitlines() if ln.startswith("run the best: ")).removeprefix("run the best: ")
    assert command == best["train_command"]
    # gpt-small's fastest plan on 8 A100s uses ZeRO; plain data parallelism is within 50 % of it
    assert best["prediction"]["step_time_s"] > fastest["prediction"]["step_time_s"]
    assert (f"tie within the ±50.0 % band: chose the simpler {Layout.from_json(best['planner_plan']).describe()} "
            f"over {Layout.from_json(fastest['planner_plan']).describe()}") in out
    _with_typical(monkeypatch, 1e-6)  # no band: the search's own order and resolution
    rc, out, err = run([*argv, "--json"], capsys)
    assert rc == 0 and json.loads(out)["recommended"] == 0


def test_plan_and_parallel_auto_recommend_the_same_layout(capsys):
    """Both search the same pool and take ``ranked``'s first: ``--parallel.auto`` runs what ``plan`` prints."""
    from shardwise.runtime.config import load_config, validate
    from shardwise.runtime.planning import auto_layout, config_from_plan

    calibration = str(BENCH / "hardware_cpu_2ranks.json")
    flags = ["--preset", "gpt-small", "--parallel.nproc", "2", "--parallel.calibration", calibration]
    rc, out, err = run(["plan", *flags, "--json"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    best = Layout.from_json(data["plans"][data["recommended"]]["planner_plan"])
    cfg = validate(load_config(preset="gpt-small", overrides={"parallel.nproc": 2, "parallel.auto": True,
                                                              "parallel.calibration": calibration}), launch=False)
    chosen, lines = auto_layout(cfg, {}, device="cpu", nproc=2)
    fields = config_from_plan(best)
    assert {k: getattr(chosen.parallel, k) for k in ("dp", "tp", "pp", "zero_stage", "micro_batch")} == \
        {k: fields[k] for k in ("dp", "tp", "pp", "zero_stage", "micro_batch")}
    assert any("parallel.auto chose" in line for line in lines)
