"""``shardwise bench sbp``: eager overhead of global-tensor ops and boxing against torch's DTensor, and the
bytes each planned boxing conversion moves.

    shardwise bench sbp -n 2 --iters 2000

Every rank times the same loops; rank 0 prints the table (max over ranks of the mean time per call).
"""

from __future__ import annotations

import argparse
import itertools
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .harness import add_launch_arguments, run_bench

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--iters", type=int, default=2000, help="timed calls per measurement")


def _validate(args: argparse.Namespace) -> None:
    if args.iters < 1:
        raise ValueError(f"--iters must be >= 1, got {args.iters}")


def _run_worker(args: argparse.Namespace) -> int:
    _worker(args.iters)
    return 0


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("sbp", args, validate=_validate, worker=_run_worker)


def _time(fn: Callable[[], object], iters: int) -> float:
    for _ in range(min(50, iters)):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    us = (time.perf_counter() - t0) / iters * 1e6
    out = torch.tensor([us], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def _op_rows(mesh, iters: int) -> list[tuple[str, float, float, float]]:
    import shardwise as sw
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dm = init_device_mesh("cpu", (mesh.size("dp"),))
    n = mesh.size("dp")
    a, b = torch.randn(64 * n, 64), torch.randn(64 * n, 64)
    w = torch.randn(64, 64)
    la, lb = a[:64].clone(), b[:64].clone()
    ga, gb, gw = sw.distribute(a, mesh, "S(0)"), sw.distribute(b, mesh, "S(0)"), sw.distribute(w, mesh, "B")
    da, db = distribute_tensor(a, dm, [Shard(0)]), distribute_tensor(b, dm, [Shard(0)])
    dw = distribute_tensor(w, dm, [Replicate()])
    rows = [
        ("add 64x64 S(0)+S(0)", _time(lambda: la + lb, iters), _time(lambda: ga + gb, iters),
         _time(lambda: da + db, iters)),
        ("linear 64x64 S(0) x B", _time(lambda: F.linear(la, w), iters), _time(lambda: F.linear(ga, gw), iters),
         _time(lambda: F.linear(da, dw), iters)),
        ("gelu 64x64 S(0)", _time(lambda: F.gelu(la), iters), _time(lambda: F.gelu(ga), iters),
         _time(lambda: F.gelu(da), iters)),
        ("S(0) -> B all-gather 64x64/rank", _time(lambda: sw.comm.all_gather(la, mesh, "dp"), iters // 4),
         _time(lambda: ga.to_sbp("B"), iters // 4), _time(lambda: da.redistribute(dm, [Replicate()]), iters // 4)),
    ]
    return rows


def _bytes_table(n: int) -> list[tuple[str, str, int, str]]:
    from ..sbp.boxing import route_boxing
    from ..sbp.placement import Replicate, Partial, Split

    places = [Split(0), Split(1), Replicate(), Partial()]
    rows = []
    for src, dst in itertools.product(places, repeat=2):
        plan = route_boxing((1024, 1024), 4, (src,), (dst,), (n,), ("dp",))
        rows.append((str(src), str(dst), plan.bytes_sent, " + ".join(s.collective for s in plan.steps) or "-"))
    return rows


def _worker(iters: int) -> None:
    import shardwise as sw

    world = sw.init()
    mesh = sw.Mesh(dp=-1)
    rows = _op_rows(mesh, iters)
    if world.rank == 0:
        print(f"# shardwise bench sbp: {world.world_size} ranks, backend {world.backend}, {iters} iters, "
              f"torch {torch.__version__}")
        print(f"{'op':34} {'local us':>9} {'shardwise us':>13} {'DTensor us':>11} {'sw overhead':>12} "
              f"{'DTensor overhead':>17} {'ratio':>6}")
        for name, local, ours, theirs in rows:
            o, t = ours - local, theirs - local
            print(f"{name:34} {local:9.2f} {ours:13.2f} {theirs:11.2f} {o:12.2f} {t:17.2f} "
                  f"{(o / t if t > 0 else float('nan')):6.2f}")
        print(f"\n# planned boxing on a 1-D mesh of {world.world_size}, 1024x1024 float32 (4 MiB): bytes sent per rank")
        print(f"{'from':6} {'to':6} {'bytes':>10}  steps")
        for src, dst, nbytes, steps in _bytes_table(world.world_size):
            print(f"{src:6} {dst:6} {nbytes:10d}  {steps}")
    sw.shutdown()


if __name__ == "__main__":
    from shardwise.world import exit_process

    parser = argparse.ArgumentParser(prog="shardwise bench sbp")
    add_arguments(parser)
    exit_process(main(parser.parse_args()))
