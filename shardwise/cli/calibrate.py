"""``shardwise calibrate``: measure this machine once and write one hardware file for the planner and "auto".

``shardwise calibrate --nproc 4 --out FILE`` validates its flags, then starts 4 local ranks (``run_bench``:
torchrun re-running this module with ``--worker``). Every rank then

1. runs the compute probe (``calibrate_probe.py``: GEMM FLOP/s per size and dtype, memory bandwidth, per-op overhead)
   with all ranks probing at once, as they share the machine during training;
2. measures the collectives (``bench comm``'s measurement, ``bench_op``: all_reduce, all_gather,
   reduce_scatter, broadcast × native, ring, tree over 8 B .. 64 MiB, 2 MiB with ``--quick``) on the whole
   world, then on every smaller group size ``d >= 2`` that divides ``nproc`` (2 for 4 ranks). A group size
   ``d < nproc`` is measured on ``nproc / d`` groups of ``d`` consecutive ranks **at the same time** (a mesh
   ``(rest, world=d)``: how tp groups run, every group sharing the machine); rank 0's group is reported;
3. rank 0 fits one alpha–beta model per (collective, algorithm) and group size (``fit_calibration``) and
   writes the file (schema: ``shardwise/comm/hardware.py``), by default to
   ``default_calibration_path(device, nproc)`` where ``shardwise train`` finds it for ``algorithm = "auto"``.

The collective measurement is ``shardwise bench comm``'s (``shardwise/bench/comm.py``), the launch its harness
(``shardwise/bench/harness.py``). Who reads the file: ``Hardware.load`` (``planner/calibrated.py``: the planner's
fields), ``runtime/calibration.py`` (which file ``shardwise train`` attaches to the mesh for ``algorithm="auto"``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..comm.auto import choose_algorithm
from ..comm.calibration import Calibration, fit_calibration
from ..comm.hardware import HARDWARE_FORMAT, check_hardware_calibration, default_calibration_path
from ..bench.comm import bench_op
from ..bench.comm_report import ALL_OPS, power_of_two_sizes
from ..bench.harness import add_launch_arguments, run_bench
from ..comm.ops import ALGORITHMS
from .calibrate_probe import probe_settings, run_probe

__all__ = ["add_arguments", "main", "group_sizes", "memory_bytes", "hardware_document", "summary", "auto_ranges"]

PROG = "shardwise calibrate"
TIMEOUT_S = 600.0
"""Per-collective timeout in the ranks: 64 MiB collectives of 8 ranks on 2 cores are slow."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, nproc=_default_nproc(), what="local ranks to measure with, as training will "
                         "run them (default: one per GPU, else 2)")
    parser.add_argument("--out", metavar="FILE", default=None,
                        help="where to write the hardware JSON (default: "
                             "$XDG_CACHE_HOME or ~/.cache, /shardwise/hardware-DEVICE-NPROC.json)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sizes and repetitions (collectives up to 2 MiB): a rough file in seconds")


def _default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _validate(args: argparse.Namespace) -> None:
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir():
            raise ValueError(f"--out {args.out!r} is a directory; give a file name, e.g. --out {out / 'hw.json'}")
        if not out.parent.exists():
            raise ValueError(f"--out {args.out!r}: the directory {str(out.parent)!r} does not exist; create it first")


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``--nproc`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("calibrate", args, validate=_validate, worker=_run_worker, prog=PROG, module=__name__)


def group_sizes(nproc: int) -> list[int]:
    """Group sizes to calibrate: ``nproc`` and every smaller divisor ``>= 2``, largest first. Pure."""
    return [d for d in range(nproc, 1, -1) if nproc % d == 0]


def memory_bytes(device: torch.device, nproc: int) -> int:
    """Memory of one device: the GPU's total, or on CPU the machine's RAM shared by ``nproc`` ranks."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // nproc)


def _machine(device: torch.device) -> dict[str, Any]:
    return {"host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}


def hardware_document(*, device: str, backend: str, nproc: int, memory: int, probe: dict[str, Any],
                      calibrations: list[Calibration], machine: dict[str, Any]) -> dict[str, Any]:
    """The hardware file's object (schema: ``comm/hardware.py``), checked. Pure."""
    doc = {"format": HARDWARE_FORMAT, "name": f"local-{device}-{nproc}", "device": device, "backend": backend,
           "devices_per_node": nproc, "memory_bytes": memory, "probe": probe,
           "collectives": {str(c.world_size): c.to_json() for c in calibrations}, "machine": machine}
    return check_hardware_calibration(doc, "the measured hardware calibration")


# -- inside a rank ----------------------------------------------------------------------------------

def _collectives(mesh: Any, sizes: list[int], quick: bool, machine: dict[str, Any]) -> Calibration:
    """Measure every op × algorithm on ``mesh``'s axis ``world`` and fit them. Collective over the world."""
    settings = SimpleNamespace(algorithms=list(ALGORITHMS), dtype="float32", iters=5 if quick else 8,
                               warmup=1 if quick else 2, check=True)
    rows = [row for op in ALL_OPS for row in bench_op(op, sizes, mesh, settings)]
    bad = [f"{r.op}/{r.algorithm}/{r.nbytes}" for r in rows if r.max_error]
    if bad:
        raise RuntimeError(f"shardwise calibrate: wrong collective results for {bad[:3]}; the collectives are "
                           f"broken on this machine, report it")
    return fit_calibration(((r.op, r.algorithm, r.nbytes, r.time_us) for r in rows), world_size=mesh.size("world"),
                           backend=torch.distributed.get_backend(), device=mesh.device.type, machine=machine)


def _run_worker(args: argparse.Namespace) -> int:
    """One rank of the calibration. Collective over the whole job."""
    import warnings

    import shardwise as sw

    # torch deprecates the *_tensor collectives the native algorithms call: noise, once per rank.
    warnings.filterwarnings("ignore", message=".*(reduce_scatter|all_gather_into)_tensor.*", category=FutureWarning)
    world = sw.init(timeout_s=TIMEOUT_S)
    mesh, n = sw.Mesh(world=-1), world.world_size
    lead, device = world.rank == 0, mesh.device
    sizes = power_of_two_sizes(8, (2 << 20) if args.quick else (64 << 20))
    machine = _machine(device)
    if lead:
        print(f"# {PROG}: {n} ranks, backend {world.backend}, device {device.type}"
              f"{' (quick)' if args.quick else ''}: compute probe, all ranks at once", flush=True)
    probe = run_probe(mesh, probe_settings(args.quick, mesh.device.type))
    calibrations = []
    for d in group_sizes(n):
        if lead:
            print(f"# collectives on groups of {d}" + (f" ({n // d} groups at once)" if d < n else ""), flush=True)
        sub = mesh if d == n else sw.Mesh(rest=n // d, world=d)
        calibrations.append(_collectives(sub, sizes, args.quick, machine))
    if lead:
        doc = hardware_document(device=device.type, backend=world.backend, nproc=n, memory=memory_bytes(device, n),
                                probe=probe, calibrations=calibrations, machine=machine)
        out = Path(args.out) if args.out else default_calibration_path(device.type, n)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(out)
        print(summary(doc))
        print(f"# wrote {out}")
    sw.shutdown()
    return 0


def summary(doc: dict[str, Any]) -> str:
    """A few lines for the terminal: peak GEMM, bandwidth, overhead, what "auto" picks. Pure."""
    p = doc["probe"]
    lines = [f"# {doc['name']}: {doc['memory_bytes'] / 2**30:.1f} GiB per device"]
    for dtype, rows in p["gemm"].items():
        best = max(rows, key=lambda r: r[3])
        lines.append(f"# peak GEMM {dtype}: {best[3] / 1e9:.1f} GFLOP/s per rank "
                     f"(m,n,k = {best[0]},{best[1]},{best[2]})")
    lines.append(f"# memory bandwidth {p['memory_bandwidth_Bps'] / 1e9:.2f} GB/s per rank, "
                 f"op overhead {p['op_overhead_s'] * 1e6:.2f} us")
    for key, entry in doc["collectives"].items():
        cal = Calibration.from_json(entry)
        picks = ", ".join(f"{label} {choose_algorithm(cal, 'all_reduce', b)}"
                          for label, b in (("1K", 1 << 10), ("1M", 1 << 20), ("16M", 16 << 20)))
        lines.append(f"# auto all_reduce on {key} ranks: {picks} ({auto_ranges(cal, 'all_reduce')})")
    return "\n".join(lines)


def auto_ranges(cal: Calibration, op: str, top: int = 1 << 30) -> str:
    """What "auto" runs for ``op`` over power-of-two sizes 8 B .. ``top``, as ranges, e.g.
    ``tree up to 4M, native from 8M``. Pure."""
    from ..bench.comm_report import format_size

    runs: list[list] = []  # [algorithm, first size, last size]
    for nbytes in power_of_two_sizes(8, top):
        algo = choose_algorithm(cal, op, nbytes)
        if runs and runs[-1][0] == algo:
            runs[-1][2] = nbytes
        else:
            runs.append([algo, nbytes, nbytes])
    if len(runs) == 1:
        return f"{runs[0][0]} at every size"
    parts = [f"{a} up to {format_size(hi)}" if i == 0 else f"{a} from {format_size(lo)}"
             + ("" if i == len(runs) - 1 else f" to {format_size(hi)}") for i, (a, lo, hi) in enumerate(runs)]
    return ", ".join(parts)


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.cli.calibrate",
                                      description="measure this machine (see `shardwise calibrate -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
