"""Latency–bandwidth (alpha–beta) models of the collectives, fitted from ``shardwise bench comm``.

The classic Hockney model: moving ``b`` bytes through one collective takes ``t = α + β·b`` — ``α`` is the
fixed cost of a call (message latencies, launch and Python overhead), ``β`` the cost per byte (the inverse
of the asymptotic *algorithm* bandwidth). One model is fitted per (collective, algorithm) for the world size
and machine the benchmark ran on, and written to a calibration JSON file that the planner and the boxing
cost model read back with ``load_calibration``.

``nbytes`` always means the size of the *full* buffer, as in the benchmark's ``bytes`` column (the
nccl-tests convention): the all-reduced tensor, the gathered output of an all-gather, the un-scattered input
of a reduce-scatter.

Everything here is pure (no processes, no communication).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["AlphaBeta", "Calibration", "fit_alpha_beta", "fit_calibration", "load_calibration",
           "save_calibration"]


@dataclass(frozen=True)
class AlphaBeta:
    """``t_us = alpha_us + beta_us_per_byte · nbytes`` for one (collective, algorithm)."""

    alpha_us: float
    """Fixed cost of one call in microseconds (≥ 0)."""
    beta_us_per_byte: float
    """Cost of one more byte in microseconds (≥ 0); 0 when the fit saw no bandwidth term."""
    points: int = 0
    """How many (size, time) measurements the fit used (0 when built by hand)."""
    max_rel_error: float = 0.0
    """Largest ``|predicted - measured| / measured`` over those measurements: how far to trust the model."""

    @property
    def bandwidth_GBps(self) -> float | None:
        """Asymptotic algorithm bandwidth ``1/β`` in GB/s (10^9 bytes/s); ``None`` when ``β`` is 0."""
        return 1e-3 / self.beta_us_per_byte if self.beta_us_per_byte > 0 else None

    def predict_us(self, nbytes: float) -> float:
        """Predicted time of one call on ``nbytes`` bytes, in microseconds."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return self.alpha_us + self.beta_us_per_byte * nbytes

    def to_json(self) -> dict[str, Any]:
        return {"alpha_us": self.alpha_us, "beta_us_per_byte": self.beta_us_per_byte,
                "bandwidth_GBps": self.bandwidth_GBps, "points": self.points,
                "max_rel_error": self.max_rel_error}


@dataclass(frozen=True)
class Calibration:
    """Fitted models for one world size on one machine, as read from a calibration file."""

    world_size: int
    """Ranks in the collective group the models were measured on."""
    backend: str
    """``gloo`` or ``nccl``."""
    device: str
    """``cpu`` or ``cuda``."""
    models: Mapping[str, Mapping[str, AlphaBeta]]
    """``models[collective][algorithm]``, e.g. ``models["all_reduce"]["ring"]``."""
    dtype: str = "float32"
    """Element type the benchmark moved (the models are per byte, so they carry over to other dtypes)."""
    machine: Mapping[str, Any] = field(default_factory=dict)
    """Free-form description of where it ran (host, CPU count, torch version, GPU name)."""

    def model(self, op: str, algorithm: str) -> AlphaBeta:
        """The model of ``op`` run with ``algorithm``; ``ValueError`` naming what is available otherwise."""
        if op not in self.models:
            raise ValueError(f"no calibration for collective {op!r}; this file has {sorted(self.models)}; "
                             f"re-run `shardwise bench comm --ops {op} --calibrate FILE`")
        if algorithm not in self.models[op]:
            raise ValueError(f"no calibration for {op} with algorithm {algorithm!r}; this file has "
                             f"{sorted(self.models[op])}; re-run the benchmark with --algorithms {algorithm}")
        return self.models[op][algorithm]

    def predict_us(self, op: str, algorithm: str, nbytes: float) -> float:
        """Predicted microseconds of one ``op`` call with ``algorithm`` on a full buffer of ``nbytes``."""
        return self.model(op, algorithm).predict_us(nbytes)

    def best_algorithm(self, op: str, nbytes: float) -> str:
        """The calibrated algorithm with the lowest predicted time for ``op`` at ``nbytes``."""
        if not self.models.get(op):
            raise ValueError(f"no calibration for collective {op!r}; this file has {sorted(self.models)}")
        return min(self.models[op], key=lambda a: self.models[op][a].predict_us(nbytes))

    def to_json(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "backend": self.backend, "device": self.device,
                "dtype": self.dtype,
                "models": {op: {a: m.to_json() for a, m in algos.items()} for op, algos in self.models.items()},
                "machine": dict(self.machine)}

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> "Calibration":
        """Parse the dictionary written by ``to_json``; ``ValueError`` naming the first bad field."""
        for key in ("world_size", "backend", "device", "models"):
            if key not in data:
                raise ValueError(f"calibration data lacks field {key!r} (has {sorted(data)}); "
                                 f"regenerate it with `shardwise bench comm --calibrate FILE`")
        models: dict[str, dict[str, AlphaBeta]] = {}
        for op, algos in data["models"].items():
            models[op] = {}
            for algo, m in algos.items():
                alpha, beta = float(m["alpha_us"]), float(m["beta_us_per_byte"])
                if not (math.isfinite(alpha) and math.isfinite(beta)) or alpha < 0 or beta < 0:
                    raise ValueError(f"calibration model {op}/{algo} has alpha_us={alpha}, "
                                     f"beta_us_per_byte={beta}; both must be finite and >= 0")
                models[op][algo] = AlphaBeta(alpha, beta, int(m.get("points", 0)),
                                             float(m.get("max_rel_error", 0.0)))
        return Calibration(world_size=int(data["world_size"]), backend=str(data["backend"]),
                           device=str(data["device"]), models=models, dtype=str(data.get("dtype", "float32")),
                           machine=dict(data.get("machine", {})))


def fit_alpha_beta(nbytes: Sequence[float], times_us: Sequence[float]) -> AlphaBeta:
    """Least-squares fit of ``t = α + β·b`` to measurements, minimising *relative* error.

    Sizes span many orders of magnitude (8 B … 64 MiB); an unweighted fit would spend all its freedom on
    the largest messages and return a meaningless (often negative) ``α``. Weighting each point by ``1/t``
    makes every size count alike. A negative ``α`` or ``β`` (noise on nearly flat data) is clamped to 0 and
    the other coefficient refitted alone. Exact on data that is exactly linear.
    """
    if len(nbytes) != len(times_us):
        raise ValueError(f"need one time per size, got {len(nbytes)} sizes and {len(times_us)} times")
    if not nbytes:
        raise ValueError("cannot fit an alpha-beta model to zero measurements; measure at least one size")
    if any(t <= 0 or not math.isfinite(t) for t in times_us) or any(b < 0 for b in nbytes):
        raise ValueError(f"times must be finite and > 0 and sizes >= 0, got sizes {list(nbytes)} and "
                         f"times {list(times_us)}")
    w = [1.0 / t for t in times_us]
    # Weighted normal equations for rows (w, w·b) and targets w·t.
    s11 = sum(x * x for x in w)
    s12 = sum(x * x * b for x, b in zip(w, nbytes))
    s22 = sum((x * b) ** 2 for x, b in zip(w, nbytes))
    y1 = sum(x * x * t for x, t in zip(w, times_us))
    y2 = sum(x * x * b * t for x, b, t in zip(w, nbytes, times_us))
    det = s11 * s22 - s12 * s12
    if len(set(nbytes)) >= 2 and det > 1e-12 * s11 * s22:
        alpha, beta = (y1 * s22 - y2 * s12) / det, (s11 * y2 - s12 * y1) / det
    else:  # one distinct size: no way to separate latency from bandwidth; call it all latency
        alpha, beta = y1 / s11, 0.0
    if beta < 0:
        alpha, beta = y1 / s11, 0.0
    elif alpha < 0:
        alpha, beta = 0.0, y2 / s22
    worst = max(abs(alpha + beta * b - t) / t for b, t in zip(nbytes, times_us))
    return AlphaBeta(alpha, beta, len(nbytes), worst)


def fit_calibration(measurements: Iterable[tuple[str, str, int, float]], *, world_size: int, backend: str,
                    device: str, dtype: str = "float32",
                    machine: Mapping[str, Any] | None = None) -> Calibration:
    """Fit one ``AlphaBeta`` per (op, algorithm) from ``(op, algorithm, nbytes, time_us)`` measurements."""
    grouped: dict[str, dict[str, tuple[list[int], list[float]]]] = {}
    for op, algorithm, nbytes, time_us in measurements:
        sizes, times = grouped.setdefault(op, {}).setdefault(algorithm, ([], []))
        sizes.append(nbytes)
        times.append(time_us)
    models = {op: {a: fit_alpha_beta(*pts) for a, pts in algos.items()} for op, algos in grouped.items()}
    return Calibration(world_size=world_size, backend=backend, device=device, models=models, dtype=dtype,
                       machine=dict(machine or {}))


def save_calibration(calibration: Calibration, path: str | Path) -> None:
    """Write ``calibration`` as indented JSON to ``path``."""
    Path(path).write_text(json.dumps(calibration.to_json(), indent=2) + "\n")


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file written by ``shardwise bench comm --calibrate FILE``."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"calibration file {str(path)!r} does not exist; create it with "
                         f"`shardwise bench comm -n N --calibrate {path}`") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {str(path)!r} is not valid JSON ({exc}); regenerate it") from None
    if not isinstance(data, dict):
        raise ValueError(f"calibration file {str(path)!r} holds a {type(data).__name__}, expected an object")
    return Calibration.from_json(data)
