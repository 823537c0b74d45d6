"""``shardwise bench comm``: bus bandwidth of the collectives (native vs ring vs tree vs shm) and an alpha–beta fit;
the uneven all-to-all (native vs pairwise) with ``--ops all_to_all``.

``shardwise bench comm -n 4`` validates its flags, then starts 4 local ranks through torchrun
(``run_local``) that re-run this module with ``--worker``. The same worker runs under any torchrun job, e.g.
on two nodes: ``torchrun --nnodes 2 --nproc-per-node 8 ... -m shardwise.bench.comm --worker --max-bytes 1G``
(spell ``--max-bytes``: torchrun itself rejects a bare ``--max`` as an ambiguous abbreviation).

Inside a rank, for every (op, size, algorithm): one call on data whose exact result is known analytically
(``--check``: rank ``r`` holds ``((r + j) % 8) + 1`` at element ``j``), ``--warmup`` untimed calls, a
barrier, then ``time.perf_counter`` around ``--iters`` back-to-back calls (with ``torch.cuda.synchronize``
around them on CUDA). The reported time is the maximum over ranks of the mean time per call (nccl-tests
convention). Rank 0 prints the tables and writes ``--json``, ``--plot`` and ``--calibrate`` files.
``shm`` is measured only where it can run (every rank on one host, tensors in host memory); elsewhere it is
left out with a note. The all-to-all runs ``native`` and ``pairwise`` (``sw.comm.all_to_all_single``); every
rank sends ``bytes`` split unevenly: rank ``r`` gives rank ``j`` a share ``1 + (j - r) % n`` of ``n(n+1)/2``,
so each link carries a different load and no rank's own piece is empty.
"""

from __future__ import annotations

import argparse
import platform
import time
from typing import Callable

import torch

from .comm_report import (BENCH_OPS, CHOICE_OPS, PLOT_INSTALL_HINT, BenchRow, bus_factor, format_size, parse_size,
                           power_of_two_sizes, print_table, write_json, write_plot)
from ..comm.alltoall import A2A_ALGORITHMS
from ..comm.calibration import fit_calibration, save_calibration
from ..comm.ops import ALGORITHMS
from .harness import add_launch_arguments, run_bench

__all__ = ["add_arguments", "main", "bench_op", "runnable_algorithms", "DTYPES", "AXIS"]

AXIS = "world"
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                  "float16": torch.float16, "int64": torch.int64}
PATTERN = 8
"""Rank ``r`` holds ``((r + j) % PATTERN) + 1`` at element ``j``: small integers, exact in every dtype."""
TIMEOUT_S = 300.0
_ALL_ALGORITHMS = (*ALGORITHMS, *(a for a in A2A_ALGORITHMS if a not in ALGORITHMS))
"""Per-collective timeout inside the ranks: generous, since 4 ranks on 2 cores move 64 MiB slowly."""


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _choices(allowed: tuple[str, ...], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [s.strip() for s in text.split(",") if s.strip()]
        bad = [s for s in items if s not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"unknown {what} {bad or [text]}; choose a comma-separated "
                                             f"subset of {','.join(allowed)}")
        return list(dict.fromkeys(items))  # keep order, drop repeats
    return parse


def _positive(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, what="local ranks to start")
    parser.add_argument("--ops", type=_choices(CHOICE_OPS, "collective"), default=list(BENCH_OPS),
                        help="comma-separated collectives: all_reduce,all_gather,reduce_scatter (the default), "
                             "broadcast (from coordinate 0), all_to_all (uneven splits)")
    parser.add_argument("--algorithms", type=_choices(_ALL_ALGORITHMS, "algorithm"), default=list(_ALL_ALGORITHMS),
                        help=f"comma-separated algorithms (default: {','.join(_ALL_ALGORITHMS)}; each collective "
                             f"runs those it has: all_to_all native,pairwise, the others the rest; shm is left "
                             f"out where the ranks are not on one host or use CUDA)")
    # --min-bytes/--max-bytes spell the same flags for torchrun command lines: torchrun's own parser takes
    # a bare --max anywhere on its line for an ambiguous abbreviation of its --max-restarts.
    parser.add_argument("--min", "--min-bytes", dest="min", type=_size, default=8,
                        help="smallest size in bytes, K/M/G suffixes (default 8)")
    parser.add_argument("--max", "--max-bytes", dest="max", type=_size, default=64 << 20,
                        help="largest size in bytes (default 64M)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32", help="element type (default float32)")
    parser.add_argument("--iters", type=_positive(1), default=20, help="timed calls per size (default 20)")
    parser.add_argument("--warmup", type=_positive(0), default=5, help="untimed calls per size (default 5)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare one call per size with the analytically known result (default on)")
    parser.add_argument("--json", metavar="FILE", default=None, help="write every row as JSON")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="plot busbw against size (matplotlib)")
    parser.add_argument("--calibrate", metavar="FILE", default=None,
                        help="write the fitted alpha-beta model per collective and algorithm (for the planner)")
    parser.add_argument("--plain", action="store_true", help="plain-text tables even when rich is installed")


def _validate(args: argparse.Namespace) -> list[int]:
    """Check what argparse cannot check alone; return the sizes. ``ValueError`` with the fix otherwise."""
    sizes = power_of_two_sizes(args.min, args.max)
    for op in args.ops:  # an op none of whose algorithms was asked for would print an empty table
        has = A2A_ALGORITHMS if op == "all_to_all" else ALGORITHMS
        if not set(args.algorithms) & set(has):
            raise ValueError(f"--ops {op} runs {','.join(has)} but --algorithms {','.join(args.algorithms)} names "
                             f"none of them; add one, e.g. --algorithms {','.join(args.algorithms + [has[0]])}")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(f"--plot needs matplotlib, which is not installed; {PLOT_INSTALL_HINT}") from None
    return sizes


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("comm", args, validate=_validate, worker=_run_worker)


# -- inside a rank ----------------------------------------------------------------------------------

def _pattern(count: int, rank: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Rank ``rank``'s test data: ``((rank + j) % PATTERN) + 1`` at element ``j``."""
    j = torch.arange(count, dtype=torch.int64, device=device)
    return ((j + rank) % PATTERN + 1).to(dtype)


def _summed_pattern(count: int, n: int, device: torch.device) -> torch.Tensor:
    """Exact sum over ranks ``0..n-1`` of ``_pattern`` (float64), from a closed-form table of period 8."""
    table = torch.tensor([sum((r + k) % PATTERN + 1 for r in range(n)) for k in range(PATTERN)],
                         dtype=torch.float64, device=device)
    return table[torch.arange(count, device=device) % PATTERN]


def _expected(op: str, count: int, n: int, rank: int, device: torch.device) -> torch.Tensor:
    """The exact result this rank must get (float64)."""
    if op == "all_reduce":
        return _summed_pattern(count, n, device)
    if op == "broadcast":  # everyone ends with the source's (coordinate 0's) pattern
        return _pattern(count, 0, torch.float64, device)
    shard = count // n
    if op == "all_gather":  # block r of the output is rank r's pattern of length `shard`
        idx = torch.arange(count, device=device)
        return ((idx // shard + idx % shard) % PATTERN + 1).to(torch.float64)
    return _summed_pattern(count, n, device)[rank * shard:(rank + 1) * shard]  # reduce_scatter


def _count_for(op: str, nbytes: int, n: int, itemsize: int) -> int:
    """Elements of the full buffer for a requested size; all-gather/reduce-scatter need a multiple of ``n``,
    the all-to-all a multiple of its shares' total ``n(n+1)/2``."""
    count = max(1, nbytes // itemsize)
    if op == "all_to_all":
        return max(1, count // _a2a_shares(n)) * _a2a_shares(n)
    return count if op in ("all_reduce", "broadcast") else max(n, count // n * n)


def _make_call(op: str, algorithm: str, data: torch.Tensor, mesh: object) -> Callable[[], torch.Tensor]:
    from ..comm import collectives as c

    if op == "all_reduce":
        return lambda: c.all_reduce(data, mesh, AXIS, algorithm=algorithm)  # type: ignore[return-value]
    if op == "all_gather":
        return lambda: c.all_gather(data, mesh, AXIS, algorithm=algorithm)  # type: ignore[return-value]
    if op == "broadcast":
        return lambda: c.broadcast(data, mesh, AXIS, algorithm=algorithm)  # type: ignore[return-value]
    return lambda: c.reduce_scatter(data, mesh, AXIS, algorithm=algorithm)  # type: ignore[return-value]


def _a2a_shares(n: int) -> int:
    return n * (n + 1) // 2


def _a2a_splits(count: int, n: int, src: int) -> list[int]:
    """Elements rank ``src`` sends each rank: shares ``1 + (j - src) % n`` of ``count`` (uneven, none empty)."""
    unit = count // _a2a_shares(n)
    return [unit * (1 + (j - src) % n) for j in range(n)]


def _a2a_case(algorithm: str, count: int, dtype: torch.dtype, mesh: object
              ) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor]]:
    """(the all-to-all call, its exact result as float64) for ``count`` input elements per rank: element ``k``
    of the piece from rank ``s`` holds ``((s + k) % PATTERN) + 1``, so a misplaced piece shows."""
    from ..comm.alltoall import all_to_all_single

    n, rank, device = mesh.size(AXIS), mesh.coord(AXIS), mesh.device  # type: ignore[attr-defined]
    in_splits = _a2a_splits(count, n, rank)
    out_splits = [_a2a_splits(count, n, j)[rank] for j in range(n)]
    data = torch.cat([_pattern(k, rank, dtype, device) for k in in_splits])
    out = torch.empty(sum(out_splits), dtype=dtype, device=device)

    def call() -> torch.Tensor:
        return all_to_all_single(out, data, mesh, AXIS, out_splits=out_splits, in_splits=in_splits,  # type: ignore
                                 algorithm=algorithm)

    return call, lambda: torch.cat([_pattern(k, j, torch.float64, device) for j, k in enumerate(out_splits)])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(op: str, algorithm: str, count: int, dtype: torch.dtype, mesh: object, args: argparse.Namespace
             ) -> tuple[float, float | None]:
    """(max over ranks of the mean seconds per call, max over ranks of the check error). Collective."""
    import torch.distributed as dist

    from ..comm.collectives import barrier

    n, rank, device = mesh.size(AXIS), mesh.coord(AXIS), mesh.device  # type: ignore[attr-defined]
    if op == "all_to_all":
        call, expected = _a2a_case(algorithm, count, dtype, mesh)
    else:
        data = _pattern(count // n if op == "all_gather" else count, rank, dtype, device)
        call, expected = _make_call(op, algorithm, data, mesh), lambda: _expected(op, count, n, rank, device)
    out = call()
    err = float((out.to(torch.float64) - expected()).abs().max()) if args.check else 0.0
    if op == "all_reduce":
        data.zero_()  # repeated in-place sums of the pattern would overflow float16 after a few calls
    for _ in range(args.warmup):
        call()
    _sync(device)
    barrier(mesh, AXIS)  # type: ignore[arg-type]
    _sync(device)
    start = time.perf_counter()
    for _ in range(args.iters):
        call()
    _sync(device)
    mean = (time.perf_counter() - start) / args.iters
    stats = torch.tensor([mean, err], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX, group=mesh.group(AXIS))  # type: ignore[attr-defined]
    return float(stats[0]), (float(stats[1]) if args.check else None)


def _machine(device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {"host": platform.node(), "platform": platform.platform(),
                               "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                               "python": platform.python_version()}
    import os

    info["cpu_count"] = os.cpu_count()
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def bench_op(op: str, sizes: list[int], mesh: object, args: argparse.Namespace) -> list[BenchRow]:
    """Measure ``op`` with every ``args.algorithms`` at every size on ``mesh``'s axis ``world`` (settings from
    ``args``: ``dtype``, ``iters``, ``warmup``, ``check``). Collective over that axis."""
    n = mesh.size(AXIS)  # type: ignore[attr-defined]
    dtype = DTYPES[args.dtype]
    itemsize = torch.empty((), dtype=dtype).element_size()
    has = A2A_ALGORITHMS if op == "all_to_all" else ALGORITHMS
    algorithms = runnable_algorithms([a for a in args.algorithms if a in has], mesh)
    rows, seen = [], set()
    for nbytes in sizes:
        count = _count_for(op, nbytes, n, itemsize)
        if count in seen:  # tiny sizes round up to the same buffer: measure it once
            continue
        seen.add(count)
        for algorithm in algorithms:
            seconds, err = _measure(op, algorithm, count, dtype, mesh, args)
            algbw = count * itemsize / seconds / 1e9
            rows.append(BenchRow(op=op, algorithm=algorithm, nbytes=count * itemsize, count=count,
                                 dtype=args.dtype, time_us=seconds * 1e6, algbw_GBps=algbw,
                                 busbw_GBps=algbw * bus_factor(op, n), max_error=err))
    return rows


def runnable_algorithms(algorithms: list[str], mesh: object) -> list[str]:
    """``algorithms`` without ``shm`` where it cannot run (ranks on several hosts, CUDA tensors); rank 0
    prints why. Collective over the axis (the host check, on first use)."""
    from ..comm.shm_rendezvous import shm_group_for

    if "shm" not in algorithms:
        return list(algorithms)
    why = None
    if mesh.device.type != "cpu":  # type: ignore[attr-defined]
        why = "it moves host memory and this job uses CUDA"
    elif mesh.size(AXIS) > 1 and shm_group_for(mesh, AXIS, required=False) is None:  # type: ignore
        why = "the ranks are not all on one host"
    if why is None:
        return list(algorithms)
    if mesh.rank == 0:  # type: ignore[attr-defined]
        print(f"# shm left out: {why}", flush=True)
    return [a for a in algorithms if a != "shm"]


def _run_worker(args: argparse.Namespace) -> int:
    """One rank of the benchmark. Collective over the whole job."""
    import warnings

    import shardwise as sw

    # torch deprecates reduce_scatter_tensor, which the native reduce-scatter calls: once per size is noise.
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*", category=FutureWarning)
    world = sw.init(timeout_s=TIMEOUT_S)
    mesh = sw.Mesh(world=-1)
    sizes, lead = power_of_two_sizes(args.min, args.max), mesh.rank == 0
    n, device = mesh.size(AXIS), mesh.device
    if lead:
        print(f"# shardwise bench comm: {n} ranks, backend {world.backend}, device {device.type}, "
              f"dtype {args.dtype}, sizes {format_size(sizes[0])}..{format_size(sizes[-1])}, "
              f"warmup {args.warmup}, iters {args.iters}", flush=True)
    rows: list[BenchRow] = []
    for op in args.ops:
        op_rows = bench_op(op, sizes, mesh, args)
        if lead:
            print_table(op, op_rows, n, plain=args.plain)
        rows += op_rows
    if lead:
        _write_outputs(args, rows, n, world.backend, device)
    sw.shutdown()
    return 0


def _write_outputs(args: argparse.Namespace, rows: list[BenchRow], n: int, backend: str,
                   device: torch.device) -> None:
    machine = _machine(device)
    meta = {"world_size": n, "backend": backend, "device": device.type, "dtype": args.dtype,
            "iters": args.iters, "warmup": args.warmup, "machine": machine}
    if args.json:
        write_json(args.json, rows, meta)
        print(f"# wrote {args.json}")
    if args.plot:
        write_plot(args.plot, rows, f"shardwise bench comm: {n} ranks, {backend}/{device.type}, {args.dtype}")
        print(f"# wrote {args.plot}")
    if args.calibrate:
        cal = fit_calibration(((r.op, r.algorithm, r.nbytes, r.time_us) for r in rows), world_size=n,
                              backend=backend, device=device.type, dtype=args.dtype, machine=machine)
        save_calibration(cal, args.calibrate)
        for op, algos in cal.models.items():
            for algo, m in algos.items():
                bw = "inf" if m.bandwidth_GBps is None else f"{m.bandwidth_GBps:.3f}"
                print(f"# fit {op}/{algo}: alpha {m.alpha_us:.1f} us, {bw} GB/s "
                      f"(max rel. error {m.max_rel_error:.0%} over {m.points} sizes)")
        print(f"# wrote {args.calibrate}")


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.comm",
                                      description="collective bus bandwidth (see `shardwise bench comm -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
