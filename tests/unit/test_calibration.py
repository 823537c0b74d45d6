"""Alpha-beta fit, calibration files and the benchmark's size/bandwidth arithmetic, without processes."""

from __future__ import annotations

import json

import pytest

from shardwise.comm.bench_report import bus_factor, parse_size, power_of_two_sizes
from shardwise.comm.calibration import (AlphaBeta, fit_alpha_beta, fit_calibration, load_calibration,
                                        save_calibration)


def test_fit_recovers_an_exactly_linear_model():
    sizes = [8 << k for k in range(20)]
    alpha, beta = 25.0, 1 / 5000.0  # 25 us latency, 5 GB/s
    fit = fit_alpha_beta(sizes, [alpha + beta * b for b in sizes])
    assert fit.alpha_us == pytest.approx(alpha, rel=1e-9)
    assert fit.beta_us_per_byte == pytest.approx(beta, rel=1e-9)
    assert fit.bandwidth_GBps == pytest.approx(5.0, rel=1e-9)
    assert fit.max_rel_error < 1e-9 and fit.points == 20


def test_fit_clamps_noise_to_non_negative_terms():
    flat = fit_alpha_beta([8, 16, 32], [10.0, 9.0, 8.0])  # decreasing: no bandwidth term
    assert flat.beta_us_per_byte == 0.0 and flat.alpha_us > 0
    one = fit_alpha_beta([64], [12.0])
    assert one.alpha_us == pytest.approx(12.0) and one.beta_us_per_byte == 0.0


@pytest.mark.parametrize("sizes,times,word", [([], [], "zero"), ([8, 16], [1.0], "one time per size"),
                                              ([8], [0.0], "> 0")])
def test_fit_rejects_bad_measurements(sizes, times, word):
    with pytest.raises(ValueError, match=word):
        fit_alpha_beta(sizes, times)


def test_calibration_round_trips_and_predicts(tmp_path):
    pts = [("all_reduce", "ring", b, 100 + b / 1000) for b in (8, 1 << 20, 1 << 24)]
    pts += [("all_reduce", "tree", b, 20 + b / 100) for b in (8, 1 << 20, 1 << 24)]
    cal = fit_calibration(pts, world_size=4, backend="gloo", device="cpu", machine={"host": "test"})
    path = tmp_path / "cal.json"
    save_calibration(cal, path)
    back = load_calibration(path)
    assert back.world_size == 4 and back.machine == {"host": "test"}
    assert back.predict_us("all_reduce", "ring", 1 << 20) == pytest.approx(100 + (1 << 20) / 1000, rel=1e-6)
    # Tree wins on latency, ring on bandwidth: the crossover is where 20 + b/100 = 100 + b/1000.
    assert back.best_algorithm("all_reduce", 8) == "tree"
    assert back.best_algorithm("all_reduce", 1 << 24) == "ring"
    with pytest.raises(ValueError, match="native"):
        back.model("all_reduce", "native")
    with pytest.raises(ValueError, match="all_gather"):
        back.model("all_gather", "ring")


def test_bad_calibration_files_say_how_to_regenerate(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_calibration(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"world_size": 2, "backend": "gloo", "device": "cpu",
                               "models": {"all_reduce": {"ring": {"alpha_us": -1, "beta_us_per_byte": 0}}}}))
    with pytest.raises(ValueError, match=">= 0"):
        load_calibration(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_calibration(bad)


def test_alpha_beta_predict_rejects_negative_sizes():
    with pytest.raises(ValueError):
        AlphaBeta(1.0, 0.5).predict_us(-1)


def test_bus_factors_follow_nccl_tests():
    assert bus_factor("all_reduce", 4) == 1.5 and bus_factor("all_reduce", 1) == 0.0
    assert bus_factor("all_gather", 4) == 0.75 and bus_factor("reduce_scatter", 2) == 0.5
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 2)


def test_sizes():
    assert parse_size("8") == 8 and parse_size("64K") == 65536 and parse_size("64M") == 64 << 20
    assert parse_size("1GiB") == 1 << 30
    assert power_of_two_sizes(8, 64) == [8, 16, 32, 64]
    assert power_of_two_sizes(5, 9) == [8]
    with pytest.raises(ValueError, match="larger than"):
        power_of_two_sizes(1 << 20, 8)
    with pytest.raises(ValueError, match="byte count"):
        parse_size("lots")
