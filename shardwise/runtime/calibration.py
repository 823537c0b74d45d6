"""Which collective calibration ``parallel.algorithm = "auto"`` runs with in ``shardwise train``.

``parallel.calibration`` names a hardware file of ``shardwise calibrate`` (checked by the launcher before
anything starts); empty, the *local calibration* ``default_calibration_path(device, nproc)`` is used when it
exists (a broken local file is ignored with a warning: it was never asked for). Its collective models are
attached to the mesh, and "auto" picks native, ring or tree per message from them; without a calibration
"auto" is native. Every rank must attach the same models (a different file on another node would make
ranks pick different algorithms and hang), so ranks compare a checksum once and fall back to none if they
differ.
"""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path
from typing import Sequence

import torch
import torch.distributed as dist

from ..comm.calibration import Calibration
from ..comm.hardware import default_calibration_path, hardware_collectives, load_hardware_calibration
from .config_schema import ParallelConfig

__all__ = ["calibration_file", "calibration_note", "check_calibration_setting", "mesh_calibrations"]


def calibration_file(p: ParallelConfig, device: str, nproc: int) -> Path | None:
    """The hardware file "auto" will read: ``parallel.calibration``, else the local one if it exists; ``None``
    when the algorithm is not ``auto`` or there is none."""
    if p.algorithm != "auto":
        return None
    if p.calibration:
        return Path(p.calibration)
    local = default_calibration_path(device, nproc)
    return local if local.is_file() else None


def calibration_note(p: ParallelConfig, device: str, nproc: int) -> str | None:
    """The launcher's line naming the file "auto" chooses from; ``None`` without one, or when the local file is
    unreadable (each rank 0 then warns that auto runs native)."""
    path = calibration_file(p, device, nproc)
    if path is None:
        return None
    try:
        load_hardware_calibration(path)
    except ValueError:
        return None
    return f"shardwise train: algorithm auto: collectives chosen per message size from {path}"


def check_calibration_setting(p: ParallelConfig) -> str:
    """``parallel.calibration`` as an absolute path after checking the file (``ValueError`` naming the field
    and the fix otherwise); ``""`` stays ``""``. For the launcher, before anything starts."""
    if not p.calibration:
        return ""
    try:
        load_hardware_calibration(p.calibration)
    except ValueError as exc:
        raise ValueError(f"parallel.calibration: {exc}") from None
    return str(Path(p.calibration).resolve())


def _checksum(cals: Sequence[Calibration]) -> int:
    text = json.dumps([c.to_json() for c in cals], sort_keys=True)
    return zlib.crc32(text.encode()) + 1 if cals else 0


def mesh_calibrations(p: ParallelConfig, device: torch.device, rank: int, world_size: int) -> list[Calibration]:
    """The calibrations to attach to the training mesh (``[]``: "auto" is native). Collective over the world
    (one tiny all-reduce) when ``parallel.algorithm`` is ``auto``."""
    if p.algorithm != "auto":
        return []
    path = calibration_file(p, device.type, world_size)
    cals: list[Calibration] = []
    if path is not None:
        try:
            cals = hardware_collectives(load_hardware_calibration(path))
        except ValueError as exc:
            if p.calibration:  # asked for explicitly: the launcher checked it, so this is a real failure
                raise
            if rank == 0:
                print(f"shardwise train: warning: ignoring the local calibration ({exc}); algorithm auto runs "
                      f"native", file=sys.stderr, flush=True)
    mine = _checksum(cals)
    both = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        if rank == 0:
            print("shardwise train: warning: the ranks found different calibration files (one per node?); "
                  "algorithm auto runs native; copy one file to every node, or set --parallel.calibration",
                  file=sys.stderr, flush=True)
        return []
    return cals
