"""``shardwise plan`` in this process (no ranks), the Layout ↔ train-config mapping, and pins from flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.planner import Layout
from shardwise.runtime.config import load_config, validate
from shardwise.runtime.planning import config_from_plan, parse_pin, parse_pins, pins_from_flags
from shardwise.runtime.prediction import plan_from_config

from .test_predict_cli import run  # cli.main in this process: (exit code, stdout, stderr)

GPT3 = ["--model.n_layer", "96", "--model.n_embd", "12288", "--model.n_head", "96", "--model.vocab_size", "51200",
        "--model.block_size", "2048"]


@pytest.fixture(autouse=True)
def no_local_calibration(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.mark.parametrize("plan", [
    Layout(dp=4, micro_batch=2, grad_accum=2),
    Layout(dp=2, tp=2, zero_stage=1, micro_batch=4, grad_accum=1, activation_checkpointing="full"),
    Layout(dp=1, pp=4, micro_batch=2, grad_accum=1, microbatches=8, schedule="zb-h1", pp_split=("blocks.1", "blocks.3",
                                                                                              "blocks.5")),
    Layout(dp=1, pp=2, micro_batch=1, grad_accum=2, microbatches=4, schedule="interleaved", chunks=2),
    Layout(dp=2, cp=2, micro_batch=2, grad_accum=1),
    Layout(dp=1, cp=2, tp=2, zero_stage=3, micro_batch=2, grad_accum=2, activation_checkpointing="full"),
    Layout(dp=1, cp=2, pp=2, micro_batch=1, grad_accum=1, microbatches=4, schedule="1f1b"),
])
def test_a_plan_maps_to_the_train_config_that_runs_it(plan: Layout):
    """config_from_plan → validate (train's checks) → plan_from_config(train's reading) is the plan again."""
    fields = config_from_plan(plan)
    batch = plan.dp * plan.grad_accum * plan.micro_batch * (plan.microbatches if plan.pp > 1 else 1)
    overrides = {f"parallel.{k}": v for k, v in fields.items()}
    overrides.update({"parallel.nproc": plan.devices, "data.global_batch": batch, "model.n_layer": 6})
    cfg = validate(load_config(preset="gpt-tiny", overrides=overrides))
    back = plan_from_config(cfg, train_passes=True)
    assert back.resolved(batch) == Layout.from_json({**plan.to_json(), "precision": "fp32"}).resolved(batch)


def test_config_from_plan_refuses_what_train_cannot_run():
    assert config_from_plan(Layout(tp=2, sequence_parallel=True))["sequence_parallel"] is True
    assert config_from_plan(Layout(tp=2))["sequence_parallel"] is False
    assert config_from_plan(Layout(activation_checkpointing="selective"))["activation_checkpointing"] == "selective"
    with pytest.raises(ValueError, match="bf16-mixed"):
        config_from_plan(Layout(precision="bf16-mixed"))


def test_sequence_parallel_round_trips_and_auto_refuses_it():
    cfg = validate(load_config(preset="gpt-tiny", overrides={"parallel.nproc": 2, "parallel.tp": 2,
                                                            "parallel.sequence_parallel": True}))
    assert plan_from_config(cfg).sequence_parallel is True
    from shardwise.runtime.planning import auto_layout
    with pytest.raises(ValueError, match="parallel.auto does not search sequence parallelism"):
        auto_layout(cfg, {"parallel.sequence_parallel": "true"}, device="cpu", nproc=2)


def test_pins_parse_and_translate():
    assert parse_pin("parallel.tp=8") == ("tp", 8)
    assert parse_pin("parallel.pp_schedule=1f1b") == ("pp_schedule", "1f1b")
    assert parse_pin("modules.wte=replicate") == ("modules.wte", "replicate")
    pins = pins_from_flags({"tp": 2, "pp": 2, "pp_schedule": "zb-h1", "micro_batch": 8, "pp_microbatches": 4,
                            "modules.wte": "replicate"})
    assert pins == {"tp": 2, "pp": 2, "schedule": "zb-h1", "microbatches": 4, "micro_batch": 2,
                    "modules": {"wte": "replicate"}}
    for bad, match in (("parallel.tp", "FIELD=VALUE"), ("parallel.warp=2", "cannot be pinned"),
                       ("parallel.tp=two", "whole number")):
        with pytest.raises(ValueError, match=match):
            parse_pin(bad)
    with pytest.raises(ValueError, match="needs parallel.pp"):
        pins_from_flags({"micro_batch": 8})


def test_contradicting_pins_are_one_line_errors(capsys):
    assert parse_pins(["parallel.tp=2", "parallel.pp=2", "parallel.tp=2"]) == {"tp": 2, "pp": 2}
    with pytest.raises(ValueError, match=r"'parallel.tp=2'.*'parallel.tp=4'.*contradict"):
        parse_pins(["parallel.tp=2", "parallel.tp=4"])
    with pytest.raises(ValueError, match=r"pp_schedule = 'foo' is not one of.*zb-h1"):
        pins_from_flags(parse_pins(["parallel.pp_schedule=foo"]))
    rc, out, err = run(["plan", "--parallel.nproc", "4", "--hardware", "a100-80g-sxm",
                        "--pin", "parallel.tp=2", "--pin", "parallel.tp=4"], capsys)
    assert rc == 2 and out == "" and "contradict" in err and len(err.strip().splitlines()) == 1


def test_plan_json_lists_ranked_plans_with_train_fields(capsys):
    rc, out, err = run(["plan", *GPT3, "--parallel.nproc", "1024", "--data.global_batch", "1536",
                        "--train.precision", "bf16", "--hardware", "a100-80g-sxm", "--top", "3", "--json"], capsys)
    assert rc == 0, err
    data = json.loads(out)  # stdout is one JSON object, nothing else
    assert len(data["plans"]) == 3 and data["search_s"] > 0
    times = [p["prediction"]["step_time_s"] for p in data["plans"]]
    assert times == sorted(times)
    first = data["plans"][0]
    assert set(first["plan"]) >= {"dp", "tp", "pp", "zero_stage", "micro_batch", "pp_schedule", "pp_chunks"}
    assert first["plan"]["dp"] * first["plan"]["tp"] * first["plan"]["pp"] == 1024
    assert first["plan"]["tp"] <= 8  # within a node unless pinned
    assert first["prediction"]["fits"] is True
    assert {"step_time_s", "tokens_per_s", "tflops_per_device", "mfu", "memory", "breakdown"} <= set(
        first["prediction"])


def test_plan_pins_and_explain(capsys):
    rc, out, err = run(["plan", "--preset", "gpt-small", "--parallel.nproc", "8", "--hardware", "a100-80g-sxm",
                        "--pin", "parallel.tp=2", "--pin", "parallel.pp=2", "--pin", "parallel.pp_schedule=1f1b",
                        "--explain", "--json"], capsys)
    assert rc == 0, err
    data = json.loads(out)
    assert all(p["plan"]["tp"] == 2 and p["plan"]["pp"] == 2 and p["plan"]["pp_schedule"] == "1f1b"
               for p in data["plans"])
    assert data["pruned"] and all({"reason", "count", "example"} <= set(r) for r in data["pruned"])
    rc, out, err = run(["plan", "--preset", "gpt-small", "--parallel.nproc", "8", "--hardware", "a100-80g-sxm",
                        "--explain"], capsys)
    assert rc == 0 and "runner-up" in out and "pruned regions" in out
    assert "run the best: shardwise train --preset gpt-small --data.global_batch" in out and "--parallel.dp" in out


@pytest.mark.parametrize("argv, match", [
    (["--parallel.nproc", "0"], "give the number of devices"),
    (["--parallel.nproc", "8", "--pin", "parallel.tp=3"], "divisor of the 8 devices"),
    (["--parallel.nproc", "8", "--pin", "parallel.dp=4", "--pin", "parallel.tp=4", "--pin", "parallel.pp=2"],
     "must equal the device count"),
    (["--parallel.nproc", "8", "--hardware", "tpu-v9"], "tpu-v9"),
])
def test_plan_bad_input_is_one_line(argv, match, capsys):
    rc, out, err = run(["plan", "--preset", "gpt-small", *argv, *([] if "--hardware" in argv else
                                                                  ["--hardware", "a100-80g-sxm"])], capsys)
    assert rc == 2 and out == ""
    assert match in err and len(err.strip().splitlines()) == 1


def test_plan_a_model_that_fits_nowhere(capsys):
    rc, out, err = run(["plan", *GPT3, "--parallel.nproc", "8", "--data.global_batch", "8", "--hardware",
                        "a100-80g-sxm"], capsys)
    assert rc == 2 and "fits no layout" in err and "closest" in err and "GiB per device" in err


def test_auto_and_the_printed_prediction_share_one_probe(monkeypatch):
    """Without a calibration the machine is probed once per process: --parallel.auto's choice and the
    prediction printed before launch use the same numbers."""
    from shardwise.runtime import prediction

    calls = []
    real = prediction.quick_probe_hardware
    monkeypatch.setattr(prediction, "_PROBED", {})
    monkeypatch.setattr(prediction, "quick_probe_hardware",
                        lambda nproc, device="cpu": calls.append(nproc) or real(nproc, device=device))
    cfg = load_config(preset="gpt-tiny", overrides={"parallel.nproc": 2})
    first, where = prediction.launch_hardware(cfg, device="cpu", nproc=2)
    again, _ = prediction.launch_hardware(cfg, device="cpu", nproc=2)
    assert first is again and calls == [2] and "quick probe" in where


def test_module_pins_run_as_parallel_replicate(capsys):
    """``--pin modules.wte=replicate`` (or train's ``parallel.replicate``) is costed with the embedding and its
    tied head whole on every tp rank, and the printed flags carry it to train; the predicted memory of a tp
    layout grows by the vocabulary table it no longer splits."""
    from shardwise.runtime.prediction import gpt_spec

    assert pins_from_flags({"replicate": ("lm_head",)}) == {"modules": {"ln_f": "replicate"}}
    assert pins_from_flags({"modules.lm_head": "replicate"}) == {"modules": {"ln_f": "replicate"}}
    assert parse_pin("parallel.replicate=wte") == ("replicate", ("wte",))
    rc, out, err = run(["plan", "--preset", "gpt-small", "--model.vocab_size", "32768", "--parallel.nproc", "4",
                        "--hardware", "a100-80g-sxm", "--pin", "parallel.tp=2", "--pin", "modules.wte=replicate",
                        "--json"], capsys)
    assert rc == 0, err
    plans = json.loads(out)["plans"]
    assert plans and all(p["plan"]["replicate"] == ["wte"] for p in plans)
    rc, out, err = run(["plan", "--preset", "gpt-small", "--parallel.nproc", "4", "--hardware", "a100-80g-sxm",
                        "--pin", "parallel.tp=2", "--pin", "modules.wte=replicate"], capsys)
    assert rc == 0 and "--parallel.replicate wte" in out, err
    base = validate(load_config(preset="gpt-small", overrides={"model.vocab_size": 32768, "parallel.nproc": 2,
                                                                 "parallel.tp": 2}), launch=False)
    whole = validate(load_config(preset="gpt-small", overrides={"model.vocab_size": 32768, "parallel.nproc": 2,
                                                                  "parallel.tp": 2, "parallel.replicate": "wte"}),
                     launch=False)
    spec = gpt_spec(whole)
    assert {layer.name for layer in spec.layers if layer.replicated} == {"wte", "ln_f"}
    from shardwise.planner import Hardware, predict

    hw = Hardware.preset("a100-80g-sxm")
    split = predict(gpt_spec(base), plan_from_config(base), hw, global_batch=base.data.global_batch)
    kept = predict(spec, plan_from_config(whole), hw, global_batch=whole.data.global_batch)
    table = 32768 * 256  # the embedding weight, shared by the head
    assert kept.memory.params - split.memory.params == pytest.approx(table * 4 / 2, rel=0.01)
    with pytest.raises(ValueError, match="cannot be kept whole"):
        validate(load_config(preset="gpt-small", overrides={"parallel.replicate": "blocks.0"}), launch=False)


def test_pinned_values_the_config_refuses_are_named_as_given():
    for pairs, match in (({"zero_stage": 5}, r"pin parallel.zero_stage = 5 must be 0, 1, 2 or 3"),
                         ({"pp_schedule": "foo"}, r"pin parallel.pp_schedule = 'foo' is not one of"),
                         ({"tp": -2}, r"pin parallel.tp = -2 must be a whole number >= 1"),
                         ({"pp_chunks": 0}, r"pin parallel.pp_chunks = 0 must be")):
        with pytest.raises(ValueError, match=match):
            pins_from_flags(pairs)
    # 0 is the config's "infer it" for dp, grad_accum and pp_microbatches: no pin at all
    assert pins_from_flags({"dp": 0, "grad_accum": 0, "pp_microbatches": 0, "tp": 2}) == {"tp": 2}


def test_auto_keeps_cp_1_with_dropout_and_refuses_a_cp_pin_in_one_line(monkeypatch: pytest.MonkeyPatch):
    """The ring has no dropout: with model.dropout > 0 the search keeps cp = 1 (else every cp plan would be
    refused after the search), and a given cp > 1 is the config's one-line refusal, before any search."""
    from shardwise.runtime import planning, prediction

    seen: list[dict] = []

    def capture(cfg, hw, *, devices, pins, top):
        seen.append(dict(pins))
        raise RuntimeError("searched")

    monkeypatch.setattr(prediction, "launch_hardware", lambda cfg, device, nproc: (None, "test"))
    monkeypatch.setattr(planning, "plan_config", capture)
    cfg = load_config(preset="gpt-tiny", overrides={"parallel.nproc": 2, "model.dropout": 0.1})
    with pytest.raises(RuntimeError, match="searched"):
        planning.auto_layout(cfg, {}, device="cpu", nproc=2)
    assert seen[-1]["cp"] == 1
    no_dropout = load_config(preset="gpt-tiny", overrides={"parallel.nproc": 2, "model.dropout": 0.0})
    with pytest.raises(RuntimeError, match="searched"):
        planning.auto_layout(no_dropout, {}, device="cpu", nproc=2)
    assert "cp" not in seen[-1]  # searched where the planner finds it pays
    pinned = load_config(preset="gpt-tiny", overrides={"parallel.nproc": 2, "model.dropout": 0.1, "parallel.cp": 2})
    with pytest.raises(ValueError, match="ring attention, which has no dropout"):
        planning.auto_layout(pinned, {"parallel.cp": "2"}, device="cpu", nproc=2)
    assert len(seen) == 2
