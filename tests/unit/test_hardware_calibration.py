"""Pure parts of `shardwise calibrate` and `algorithm="auto"`: the choice from fitted costs, the hardware file's
reader and its one-line errors, the default path, and which file `shardwise train` picks."""

from __future__ import annotations

import copy
import json

import pytest

from shardwise.cli.calibrate import auto_ranges, group_sizes, hardware_document, summary
from shardwise.cli.calibrate_probe import gemm_shapes, probe_settings
from shardwise.comm.auto import choose_algorithm
from shardwise.comm.calibration import AlphaBeta, Calibration
from shardwise.comm.hardware import (HARDWARE_FORMAT, default_calibration_path, hardware_collectives,
                                     load_hardware_calibration)
from shardwise.runtime.calibration import calibration_file, check_calibration_setting
from shardwise.runtime.config import ParallelConfig

CROSSOVER = 64 << 10


def crossover_calibration(world_size: int = 2) -> Calibration:
    """Tree cheaper below 64 KiB, ring above (equal at 64 KiB); native never best."""
    # tree: 50 us + 1e-3 us/B; ring: 50 + 64 KiB * 0.5e-3 = 82.768 us + 0.5e-3 us/B: equal at 64 KiB
    tree, ring = AlphaBeta(50.0, 1e-3), AlphaBeta(50.0 + CROSSOVER * 0.5e-3, 0.5e-3)
    native = AlphaBeta(400.0, 2e-3)
    models = {"all_reduce": {"native": native, "ring": ring, "tree": tree}}
    return Calibration(world_size=world_size, backend="gloo", device="cpu", models=models)


def test_auto_picks_the_lowest_fitted_cost_on_each_side_of_the_crossover():
    cal = crossover_calibration()
    assert choose_algorithm(cal, "all_reduce", 1 << 10) == "tree"
    assert choose_algorithm(cal, "all_reduce", CROSSOVER // 2) == "tree"
    assert choose_algorithm(cal, "all_reduce", CROSSOVER * 2) == "ring"
    assert choose_algorithm(cal, "all_reduce", 16 << 20) == "ring"
    for nbytes in (8, 1 << 10, 1 << 20, 64 << 20):  # the same answer as Calibration.best_algorithm
        assert choose_algorithm(cal, "all_reduce", nbytes) == cal.best_algorithm("all_reduce", nbytes)


def test_auto_is_native_without_a_model():
    cal = crossover_calibration()
    assert choose_algorithm(None, "all_reduce", 1 << 10) == "native"
    assert choose_algorithm(cal, "broadcast", 1 << 10) == "native"  # this op not calibrated
    import torch

    assert choose_algorithm(cal, "all_reduce", 1 << 10, torch.complex64) == "native"  # ring/tree cannot


def _doc() -> dict:
    probe = {"gemm": {"float32": [[64, 64, 64, 1e10], [4096, 64, 64, 3e10]], "bfloat16": [[64, 64, 64, 1e9]]},
             "memory_bandwidth_Bps": 1e10, "op_overhead_s": 3e-6}
    return hardware_document(device="cpu", backend="gloo", nproc=4, memory=6 << 30, probe=probe,
                             calibrations=[crossover_calibration(4), crossover_calibration(2)],
                             machine={"host": "h", "cpus": 2, "torch": "2", "gpu": None})


def test_hardware_document_round_trips(tmp_path):
    doc = _doc()
    assert doc["format"] == HARDWARE_FORMAT and doc["name"] == "local-cpu-4" and set(doc["collectives"]) == {"2", "4"}
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    back = load_hardware_calibration(path)
    assert back == json.loads(json.dumps(doc))
    assert [c.world_size for c in hardware_collectives(back)] == [2, 4]
    assert "auto all_reduce on 2 ranks: 1K tree, 1M ring, 16M ring" in summary(back)
    assert auto_ranges(crossover_calibration(), "all_reduce") == "tree up to 32K, ring from 64K"  # tie: ring


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("memory_bytes"), "field 'memory_bytes' must be present"),
    (lambda d: d["probe"].pop("op_overhead_s"), "field 'probe.op_overhead_s' must be present"),
    (lambda d: d.update(devices_per_node="4"), "field 'devices_per_node' must be of type int, got '4'"),
    (lambda d: d.update(format="shardwise-hardware/0"), "field 'format' must be 'shardwise-hardware/1'"),
    (lambda d: d["probe"]["gemm"]["float32"].append([64, 64, "x", 1.0]), "field 'probe.gemm.float32[2]'"),
    (lambda d: d["probe"].update(memory_bandwidth_Bps=-1), "field 'probe.memory_bandwidth_Bps' must be a positive"),
    (lambda d: d["collectives"]["2"].pop("models"), "field 'collectives.2' is not a valid calibration"),
    (lambda d: d["collectives"].update({"8": d["collectives"]["2"]}), "field 'collectives.8.world_size' must be 8"),
])
def test_loader_errors_name_the_field_and_the_fix(tmp_path, edit, message):
    doc = copy.deepcopy(_doc())
    edit(doc)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as info:
        load_hardware_calibration(path)
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert "regenerate it with `shardwise calibrate --out FILE`" in text


def test_loader_missing_and_invalid_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist; create it with `shardwise calibrate --out"):
        load_hardware_calibration(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="is not valid JSON"):
        load_hardware_calibration(tmp_path / "bad.json")


def test_default_path_respects_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_calibration_path("cpu", 4) == tmp_path / "shardwise" / "hardware-cpu-4.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_calibration_path("cuda", 8) == tmp_path / "home" / ".cache" / "shardwise" / "hardware-cuda-8.json"
    with pytest.raises(ValueError, match="nproc >= 1"):
        default_calibration_path("cpu", 0)


def test_train_picks_the_local_calibration_only_for_auto(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    auto = ParallelConfig(algorithm="auto")
    assert calibration_file(auto, "cpu", 4) is None  # no local file yet
    local = default_calibration_path("cpu", 4)
    local.parent.mkdir(parents=True)
    local.write_text(json.dumps(_doc()))
    assert calibration_file(auto, "cpu", 4) == local
    assert calibration_file(ParallelConfig(algorithm="native"), "cpu", 4) is None
    assert check_calibration_setting(auto) == ""
    explicit = ParallelConfig(algorithm="auto", calibration=str(local))
    assert calibration_file(explicit, "cpu", 2) == local and check_calibration_setting(explicit) == str(local)
    with pytest.raises(ValueError, match="parallel.calibration: hardware calibration .* does not exist"):
        check_calibration_setting(ParallelConfig(calibration=str(tmp_path / "nope.json")))


def test_group_sizes_and_probe_shapes():
    assert group_sizes(2) == [2] and group_sizes(4) == [4, 2] and group_sizes(3) == [3] and group_sizes(1) == []
    shapes = gemm_shapes(probe_settings(quick=True))
    flops = [m * n * k for m, n, k in shapes]
    assert flops == sorted(flops) and (64, 64, 64) in shapes and any(m > n for m, n, _ in shapes)


def test_launcher_names_the_calibration_only_when_it_loads(monkeypatch, tmp_path):
    from shardwise.runtime.calibration import calibration_note

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    local = default_calibration_path("cpu", 4)
    local.parent.mkdir(parents=True)
    local.write_text(json.dumps(_doc()))
    assert str(local) in calibration_note(ParallelConfig(), "cpu", 4)
    local.write_text("{}")  # broken: the ranks warn and run native; the launcher claims nothing
    assert calibration_note(ParallelConfig(), "cpu", 4) is None
    assert calibration_note(ParallelConfig(algorithm="ring"), "cpu", 4) is None
