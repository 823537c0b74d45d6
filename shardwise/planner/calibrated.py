"""``Hardware`` fields from a calibration file of the user's own machine (written by ``shardwise calibrate``).

The file's schema, its checker and its default path are ``comm/hardware.py`` (the lowest layer that reads it:
the trainer attaches its collective models to the mesh); this module is the planner's reading of it.

The file holds what ran *with every rank busy at once* (ranks share the host's cores and memory bus, as they do
in training): GEMM throughput per rank for a sweep of shapes, elementwise bandwidth, the cost of one tiny op,
and fitted alpha–beta models of the collectives for each group size measured. From them:

* ``peak_flops[dtype]`` = the best GEMM throughput measured, ``gemm_curve`` = every shape's throughput over that
  peak, keyed by the shape's cube-root size (so the roofline of ``Hardware.gemm_time`` reproduces each probe);
* the intra-node ``Link`` from the native all-reduce of the largest group (``β`` → bus bandwidth
  ``2(n-1)/n / β``, ``α`` → ``α / 2(n-1)`` per step); a one-node calibration knows no inter-node link, so it
  reuses the intra one (said in ``source``);
* ``collectives`` keeps the fitted models themselves, which ``Hardware.collective_time`` prefers.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..comm.calibration import Calibration
from ..comm.hardware import HARDWARE_FORMAT
from .link import Link

__all__ = ["hardware_fields"]

_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}


def _need(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in data:
        raise ValueError(f"{where} lacks field {key!r}; regenerate it with `shardwise calibrate --out FILE`")
    value = data[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"{where}: field {key!r} must be {getattr(kind, '__name__', kind)}, got {value!r}; "
                         f"regenerate it with `shardwise calibrate --out FILE`")
    return value


def _curve(points: list[Any], where: str) -> tuple[float, tuple[tuple[float, float], ...]]:
    """``(peak, curve)`` from ``[[m, n, k, flop_per_s], ...]``."""
    rows = []
    for p in points:
        if not (isinstance(p, (list, tuple)) and len(p) == 4 and all(isinstance(x, (int, float)) for x in p)
                and min(p) > 0):
            raise ValueError(f"{where}: every GEMM probe must be [m, n, k, flop_per_s] with positive numbers, "
                             f"got {p!r}; regenerate it with `shardwise calibrate --out FILE`")
        m, n, k, f = (float(x) for x in p)
        rows.append(((m * n * k) ** (1.0 / 3.0), f))
    if not rows:
        raise ValueError(f"{where}: no GEMM probes; regenerate it with `shardwise calibrate --out FILE`")
    peak = max(f for _, f in rows)
    by_size: dict[float, list[float]] = {}
    for d, f in rows:
        by_size.setdefault(round(d, 3), []).append(f / peak)
    # Several shapes of one size: their mean (the curve is by size only).
    curve = tuple(sorted((d, sum(e) / len(e)) for d, e in by_size.items()))
    return peak, curve


def _points(rows: list[Any], peak: float) -> tuple[tuple[float, float, float, float], ...]:
    return tuple((float(m), float(n), float(k), float(f) / peak) for m, n, k, f in rows)


def _block(probe: Mapping[str, Any], where: str) -> dict[str, float]:
    block = probe.get("block")
    if block is None:
        return {}
    keys = ("n_embd", "n_head", "seq", "batch", "fwd_s", "bwd_s")
    if not isinstance(block, dict) or any(not isinstance(block.get(k), (int, float)) or block[k] <= 0 for k in keys):
        raise ValueError(f"{where}: probe.block must have positive {list(keys)}, got {block!r}; regenerate it "
                         f"with `shardwise calibrate --out FILE`")
    out = {k: float(block[k]) for k in keys}
    # newer files add the checkpointed pass and the stack depth; older ones lack both (recomputation = one forward)
    # ... and the tiny block of ``planner/overhead.py`` (what a launch costs in eager training)
    for key in ("ckpt_s", "depth", "tiny_s", "tiny2_s", "tiny_ac_s"):
        if key in block:
            if not isinstance(block[key], (int, float)) or isinstance(block[key], bool) or block[key] <= 0:
                raise ValueError(f"{where}: probe.block.{key} must be a positive number, got {block[key]!r}; "
                                 f"regenerate it with `shardwise calibrate --out FILE`")
            out[key] = float(block[key])
    return out


def _intra_link(collectives: Mapping[int, Calibration]) -> Link:
    size = max(collectives)
    cal = collectives[size]
    model = cal.model("all_reduce", "native")
    beta_s = model.beta_us_per_byte * 1e-6
    bus = 2.0 * (size - 1) / size / beta_s if beta_s > 0 else 1e12
    return Link(alpha_s=model.alpha_us * 1e-6 / (2 * (size - 1)), bus_bandwidth_Bps=bus)


def hardware_fields(data: Any, where: str = "calibration") -> dict[str, Any]:
    """``Hardware`` keyword arguments from a parsed calibration file; ``ValueError`` naming the first bad field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} holds a {type(data).__name__}, expected an object; regenerate it with "
                         f"`shardwise calibrate --out FILE`")
    fmt = data.get("format")
    if fmt != HARDWARE_FORMAT:
        raise ValueError(f"{where} has format {fmt!r}, expected {HARDWARE_FORMAT!r}; regenerate it with "
                         f"`shardwise calibrate --out FILE`")
    probe = _need(data, "probe", dict, where)
    gemm = _need(probe, "gemm", dict, f"{where} probe")
    peaks: dict[str, float] = {}
    curves: dict[str, tuple[tuple[float, float], ...]] = {}
    for ours, theirs in _TORCH_DTYPE.items():
        if theirs in gemm:
            peaks[ours], curves[ours] = _curve(_need(gemm, theirs, list, f"{where} probe.gemm"), where)
    if "fp32" not in peaks:
        raise ValueError(f"{where}: probe.gemm lacks 'float32'; regenerate it with `shardwise calibrate --out FILE`")
    peaks.setdefault("bf16", peaks["fp32"])
    raw = _need(data, "collectives", dict, where)
    collectives = {}
    for size, cal in raw.items():
        try:
            collectives[int(size)] = Calibration.from_json(cal)
        except (TypeError, ValueError, KeyError) as exc:
            raise ValueError(f"{where}: collectives[{size!r}] is not a calibration ({exc}); regenerate it with "
                             f"`shardwise calibrate --out FILE`") from None
    # one device (``calibrate --nproc 1``): nothing to communicate with; a nominal loopback link stands in
    link = _intra_link(collectives) if collectives else Link(alpha_s=1e-4, bus_bandwidth_Bps=1e9)
    return dict(
        name=str(data.get("name", "calibrated")), peak_flops=peaks,
        memory_bytes=float(_need(data, "memory_bytes", (int, float), where)),
        memory_bandwidth_Bps=float(_need(probe, "memory_bandwidth_Bps", (int, float), f"{where} probe")),
        devices_per_node=int(_need(data, "devices_per_node", int, where)), intra=link, inter=link,
        gemm_curve=curves["fp32"], op_overhead_s=float(_need(probe, "op_overhead_s", (int, float), f"{where} probe")),
        p2p_alpha_s=link.alpha_s * 2, collectives=collectives,
        gemm_points=_points(gemm["float32"], peaks["fp32"]),
        gemm_points_bf16=_points(gemm["bfloat16"], peaks["bf16"]) if "bfloat16" in gemm else (),
        block_probe=_block(probe, where),
        sync_skew_s=float(probe.get("sync_skew_s", 0.0)),
        host_cores=int(data.get("machine", {}).get("cpus") or 0) if data.get("device") == "cpu" else 0,
        kind="cpu" if data.get("device") == "cpu" else "gpu",
        calibrated_ranks=int(data["devices_per_node"]),
        source=f"calibration {where} (one node: the inter-node link is the intra-node one)")
