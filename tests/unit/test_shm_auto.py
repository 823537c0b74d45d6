"""``algorithm="auto"`` and shm: chosen by fitted cost, left out where it cannot run (pure choice)."""

from __future__ import annotations

import torch

from shardwise.comm.auto import choose_algorithm
from shardwise.comm.calibration import AlphaBeta, Calibration, fit_calibration
from shardwise.comm.ops import ALGORITHM_CHOICES, ALGORITHMS


def _cal() -> Calibration:
    # shm: cheap calls, 4 GB/s; ring: 300 us, 2 GB/s; native: 250 us, 1 GB/s.
    models = {"all_reduce": {"native": AlphaBeta(250.0, 1e-3), "ring": AlphaBeta(300.0, 0.5e-3),
                             "shm": AlphaBeta(10.0, 0.25e-3)}}
    return Calibration(world_size=2, backend="gloo", device="cpu", models=models)


def test_shm_is_an_algorithm_and_a_choice():
    assert "shm" in ALGORITHMS and "shm" in ALGORITHM_CHOICES and ALGORITHM_CHOICES[-1] == "auto"


def test_auto_picks_shm_where_its_fitted_cost_is_lowest_and_it_can_run():
    cal = _cal()
    for nbytes in (8, 1 << 20, 64 << 20):
        assert choose_algorithm(cal, "all_reduce", nbytes) == "shm" == cal.best_algorithm("all_reduce", nbytes)
        # ranks on several hosts (or CUDA tensors): the cheapest of the others
        assert choose_algorithm(cal, "all_reduce", nbytes, shm_ok=False) == ("native" if nbytes < 100_000 else "ring")
    assert choose_algorithm(cal, "all_reduce", 8, torch.complex64) == "native"  # a dtype only the backend takes


def test_a_calibration_fitted_from_shm_rows_carries_a_shm_model():
    rows = [("all_reduce", a, b, t) for a, k in (("native", 1.0), ("shm", 0.05)) for b, t in
            ((8, 250.0 * k), (1 << 20, 1200.0 * k), (16 << 20, 15000.0 * k))]
    cal = fit_calibration(rows, world_size=2, backend="gloo", device="cpu")
    assert set(cal.models["all_reduce"]) == {"native", "shm"}
    assert choose_algorithm(cal, "all_reduce", 1 << 20) == "shm"
