"""Pure parts of `shardwise bench comm`: the alpha-beta fit, the calibration file, sizes and busbw factors."""

from __future__ import annotations

import json

import pytest

from shardwise.bench.comm_report import bus_factor, parse_size, power_of_two_sizes
from shardwise.comm.calibration import (AlphaBeta, Calibration, fit_alpha_beta, fit_calibration,
                                        load_calibration, save_calibration)


def test_fit_recovers_exact_line():
    sizes = [8, 1024, 1 << 20, 64 << 20]
    times = [50.0 + 0.002 * b for b in sizes]  # alpha 50 us, 0.5 GB/s
    m = fit_alpha_beta(sizes, times)
    assert m.alpha_us == pytest.approx(50.0, rel=1e-9)
    assert m.beta_us_per_byte == pytest.approx(0.002, rel=1e-9)
    assert m.bandwidth_GBps == pytest.approx(0.5, rel=1e-9)
    assert m.max_rel_error == pytest.approx(0.0, abs=1e-9)
    assert m.points == 4


def test_fit_clamps_negative_alpha_and_beta():
    m = fit_alpha_beta([1000, 2000, 4000], [1.0, 2.0, 4.0])  # pure bandwidth: alpha 0
    assert m.alpha_us == pytest.approx(0.0, abs=1e-9) and m.beta_us_per_byte == pytest.approx(0.001)
    flat = fit_alpha_beta([10, 20, 40], [30.0, 29.0, 28.0])  # falling times: no bandwidth term
    assert flat.beta_us_per_byte == 0.0 and flat.bandwidth_GBps is None and 28.0 < flat.alpha_us < 30.0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="zero measurements"):
        fit_alpha_beta([], [])
    with pytest.raises(ValueError, match="one time per size"):
        fit_alpha_beta([1, 2], [1.0])
    with pytest.raises(ValueError, match="> 0"):
        fit_alpha_beta([1, 2], [1.0, 0.0])


def test_calibration_round_trip_and_predict(tmp_path):
    pts = [("all_reduce", "ring", b, 100.0 + 0.001 * b) for b in (8, 4096, 1 << 20)]
    pts += [("all_reduce", "tree", b, 20.0 + 0.004 * b) for b in (8, 4096, 1 << 20)]
    cal = fit_calibration(pts, world_size=4, backend="gloo", device="cpu", machine={"host": "x"})
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    raw = json.loads(path.read_text())
    assert raw["world_size"] == 4 and raw["backend"] == "gloo" and raw["device"] == "cpu"
    assert raw["models"]["all_reduce"]["ring"]["bandwidth_GBps"] == pytest.approx(1.0)
    loaded = load_calibration(path)
    assert isinstance(loaded, Calibration) and loaded.machine == {"host": "x"}
    assert loaded.predict_us("all_reduce", "ring", 10_000) == pytest.approx(110.0)
    assert loaded.predict_us("all_reduce", "tree", 1000) == pytest.approx(24.0)
    # crossover at 80/0.003 ≈ 26.7 KB: tree below, ring above
    assert loaded.best_algorithm("all_reduce", 1000) == "tree"
    assert loaded.best_algorithm("all_reduce", 1 << 20) == "ring"
    with pytest.raises(ValueError, match="all_gather"):
        loaded.predict_us("all_gather", "ring", 8)
    with pytest.raises(ValueError, match="native"):
        loaded.predict_us("all_reduce", "native", 8)


def test_load_calibration_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"world_size": 2, "backend": "gloo", "device": "cpu",
                               "models": {"all_reduce": {"ring": {"alpha_us": -1, "beta_us_per_byte": 0}}}}))
    with pytest.raises(ValueError, match="alpha_us=-1"):
        load_calibration(bad)
    bad.write_text(json.dumps({"backend": "gloo"}))
    with pytest.raises(ValueError, match="world_size"):
        load_calibration(bad)


def test_alpha_beta_by_hand():
    m = AlphaBeta(alpha_us=5.0, beta_us_per_byte=0.01)
    assert m.predict_us(100) == pytest.approx(6.0)
    with pytest.raises(ValueError):
        m.predict_us(-1)


def test_parse_size_and_ranges():
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("64M") == 64 << 20
    assert parse_size("1G") == 1 << 30 and parse_size("4kb") == 4096 and parse_size("2MiB") == 2 << 20
    for bad in ("", "1.5M", "12X", "0", "-4"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert power_of_two_sizes(8, 64) == [8, 16, 32, 64]
    assert power_of_two_sizes(5, 40) == [8, 16, 32]
    with pytest.raises(ValueError, match="larger than --max"):
        power_of_two_sizes(1 << 20, 8)
    with pytest.raises(ValueError, match="no power of two"):
        power_of_two_sizes(100, 120)


def test_bus_factors():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("all_reduce", 1) == 0.0
    assert bus_factor("broadcast", 4) == 1.0
    with pytest.raises(ValueError):
        bus_factor("gossip", 2)
