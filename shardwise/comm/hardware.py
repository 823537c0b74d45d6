"""The machine calibration file of ``shardwise calibrate``: reading, checking, and where it lives by default.

One JSON object (``format = "shardwise-hardware/1"``) describes one machine as training sees it — ``nproc``
ranks sharing it: per-rank GEMM throughput, memory bandwidth and per-op overhead measured with every rank
busy at once (``probe``), and one collective calibration (``Calibration.to_json``) per group size
(``collectives``, keyed by the size as a string). The planner reads it (``Hardware.load``); the trainer
attaches its collective part to the mesh so that ``algorithm="auto"`` can choose per message size.

Pure: no processes, no communication; errors are one line naming the field and the fix.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping

from ..world import env_flag
from .calibration import Calibration

__all__ = ["HARDWARE_FORMAT", "default_calibration_path", "load_hardware_calibration", "check_hardware_calibration",
           "hardware_collectives"]

HARDWARE_FORMAT = "shardwise-hardware/1"
_FIX = "regenerate it with `shardwise calibrate --out FILE`"
_TOP: dict[str, type | tuple[type, ...]] = {
    "format": str, "name": str, "device": str, "backend": str, "devices_per_node": int, "memory_bytes": int,
    "probe": dict, "collectives": dict, "machine": dict}


def default_calibration_path(device: str, nproc: int) -> Path:
    """``$XDG_CACHE_HOME/shardwise/hardware-<device>-<nproc>.json`` (``~/.cache`` when unset): where
    ``shardwise calibrate`` writes without ``--out`` and where ``shardwise train`` looks for a local one."""
    if not device or "/" in device or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"default_calibration_path needs a device name such as 'cpu' or 'cuda' and nproc >= 1, "
                         f"got device={device!r}, nproc={nproc!r}")
    cache = env_flag("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "shardwise" / f"hardware-{device}-{nproc}.json"


class _Bad(ValueError):
    pass


def _need(ok: bool, where: str, field: str, wanted: str, got: Any) -> None:
    if not ok:
        shown = repr(got) if len(repr(got)) <= 60 else type(got).__name__
        raise _Bad(f"{where}: field {field!r} must be {wanted}, got {shown}; {_FIX}")


def _number(x: Any, positive: bool = True) -> bool:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
    return ok and (x > 0 if positive else x >= 0)


def _check_probe(probe: Mapping[str, Any], where: str) -> None:
    for key in ("gemm", "memory_bandwidth_Bps", "op_overhead_s"):
        _need(key in probe, where, f"probe.{key}", "present", "nothing")
    _need(isinstance(probe["gemm"], dict) and bool(probe["gemm"]), where, "probe.gemm",
          "an object {dtype: [[m, n, k, flop_per_s], ...]}", probe["gemm"])
    for dtype, rows in probe["gemm"].items():
        _need(isinstance(rows, list) and bool(rows), where, f"probe.gemm.{dtype}", "a non-empty list", rows)
        for i, row in enumerate(rows):
            _need(isinstance(row, list) and len(row) == 4 and all(_number(v) for v in row), where,
                  f"probe.gemm.{dtype}[{i}]", "[m, n, k, flop_per_s] of positive numbers", row)
    for key in ("memory_bandwidth_Bps", "op_overhead_s"):
        _need(_number(probe[key]), where, f"probe.{key}", "a positive number", probe[key])


def _check_collectives(collectives: Mapping[str, Any], where: str) -> None:
    for key, entry in collectives.items():
        _need(key.isdigit() and int(key) >= 2, where, "collectives", "keyed by group sizes >= 2 such as \"4\"", key)
        _need(isinstance(entry, dict), where, f"collectives.{key}", "a calibration object", entry)
        try:
            cal = Calibration.from_json(entry)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise _Bad(f"{where}: field 'collectives.{key}' is not a valid calibration ({exc}); {_FIX}") from None
        _need(cal.world_size == int(key), where, f"collectives.{key}.world_size", f"{key}", cal.world_size)


def check_hardware_calibration(data: Any, where: str = "hardware calibration") -> dict[str, Any]:
    """``data`` if it follows the ``shardwise-hardware/1`` schema; else ``ValueError`` naming the bad field."""
    try:
        _need(isinstance(data, dict), where, "(top level)", "a JSON object", data)
        for key, typ in _TOP.items():
            _need(key in data, where, key, "present", "nothing")
            ok = isinstance(data[key], typ) and not isinstance(data[key], bool)
            _need(ok, where, key, f"of type {getattr(typ, '__name__', typ)}", data[key])
        _need(data["format"] == HARDWARE_FORMAT, where, "format", repr(HARDWARE_FORMAT), data["format"])
        _need(data["devices_per_node"] >= 1, where, "devices_per_node", ">= 1", data["devices_per_node"])
        _need(data["memory_bytes"] > 0, where, "memory_bytes", "> 0", data["memory_bytes"])
        _check_probe(data["probe"], where)
        _check_collectives(data["collectives"], where)
    except _Bad as exc:
        raise ValueError(str(exc)) from None
    return data


def load_hardware_calibration(path: str | Path) -> dict[str, Any]:
    """Read and check the file ``shardwise calibrate --out FILE`` wrote; ``ValueError`` (one line) otherwise."""
    where = f"hardware calibration {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{where} does not exist; create it with `shardwise calibrate --out {path}`") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where} cannot be read ({exc}); {_FIX}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where} is not valid JSON ({exc}); {_FIX}") from None
    return check_hardware_calibration(data, where)


def hardware_collectives(data: Mapping[str, Any]) -> list[Calibration]:
    """The collective calibrations of a checked hardware file, one per group size (for ``Mesh(calibration=)``)."""
    return [Calibration.from_json(entry) for _, entry in sorted(data["collectives"].items(), key=lambda kv: int(kv[0]))]

