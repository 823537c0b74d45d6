"""``shardwise bench dp``: step time of ``sw.DataParallel`` against torch DDP, itself, and the centralised baseline.

``shardwise bench dp -n 2`` starts 2 local ranks through torchrun (``run_local``) that re-run this module
with ``--worker`` (any torchrun job can run the worker the same way). Every rank builds the reference GPT
and the same variants of it:

    torch-ddp          torch.nn.parallel.DistributedDataParallel (defaults: 25 MB buckets, copy-in grads)
    torch-ddp-views    the same with gradient_as_bucket_view=True
    sw                 sw.DataParallel defaults (25 MB buckets, first 1 MB, overlap, grad views)
    sw-no-overlap      all buckets reduced after backward
    sw-per-param       one bucket (one all-reduce) per parameter
    sw-copy-in         grads kept apart from the buckets, copied in and out
    sw-ring, sw-tree   our own collective algorithms instead of the backend's
    sw-shm             the all-reduces through shared memory (``algorithm="shm"``; ranks on one host, CPU)
    sw-bf16            bf16_compress_hook: gradients cross the wire in bfloat16 (half the bytes)
    centralized        reduce to rank 0, optimizer there, broadcast parameters
    sw-cap=X           the bucket-size sweep (``--sweep``)

Variants run in interleaved rounds (``--repeats`` rounds of ``--steps`` steps each), so load from other
processes hits all of them alike. A step is zero_grad, forward, backward, AdamW step. ``step ms`` is the
median over all timed steps (maximum over ranks); ``vs ddp`` is the median over rounds of the paired ratio
(this round's median step of the variant / of torch-ddp), which cancels slow drifts in machine load.
Rank 0 prints the table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from typing import Callable

import torch
import torch.nn as nn

from ..mesh import Mesh
from .harness import add_launch_arguments, paired_ratio, run_bench
from .steps import gpt_workload, set_bench_threads, time_steps

__all__ = ["add_arguments", "main"]

AXIS = "dp"
BASE = ["torch-ddp", "torch-ddp-views", "sw", "sw-no-overlap", "sw-per-param", "sw-copy-in", "sw-ring", "sw-tree",
        "sw-shm", "sw-bf16", "centralized"]
SW_OPTIONS: dict[str, dict[str, object]] = {
    "sw": {}, "sw-no-overlap": {"overlap": False}, "sw-per-param": {"bucket_cap_mb": 1e-9, "first_bucket_mb": 1e-9},
    "sw-copy-in": {"grad_views": False}, "sw-ring": {"algorithm": "ring"}, "sw-tree": {"algorithm": "tree"},
    "sw-shm": {"algorithm": "shm"}, "sw-bf16": {}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--preset", default="gpt-small", help="GPT preset (default gpt-small, ~3.3M params)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    parser.add_argument("--repeats", type=int, default=12, help="interleaved rounds (default 12)")
    parser.add_argument("--variants", default=",".join(BASE), help="comma list of: " + ", ".join(BASE))
    parser.add_argument("--sweep", default="0.25,1,4", help="more bucket_cap_mb values for sw (the sw row is 25; empty: none)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")


def _validate(args: argparse.Namespace) -> list[str]:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in BASE]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {BASE}")
    for flag in ("nproc", "batch", "seq", "steps", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    if any(x <= 0 for x in sweep):
        raise ValueError(f"--sweep values are bucket sizes in MB and must be > 0, got {sweep}")
    return names + [f"sw-cap={x:g}" for x in sweep]


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("dp", args, validate=_validate, worker=_run_worker)


# -- inside a rank ----------------------------------------------------------------------------------
Step = Callable[[torch.Tensor, torch.Tensor], None]


def _variant(name: str, net: nn.Module, mesh: Mesh) -> tuple[nn.Module, Step]:
    """Wrap ``net`` as variant ``name``; return the wrapper and one training step on a batch."""
    from ..models.gpt import lm_loss
    from ..parallel.data.centralized import CentralizedDataParallel
    from ..parallel.data.comm_hooks import bf16_compress_hook
    from ..parallel.data.data_parallel import DataParallel

    if name == "centralized":
        cdp = CentralizedDataParallel(net, mesh, AXIS, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4))

        def central_step(x: torch.Tensor, y: torch.Tensor) -> None:
            cdp.zero_grad()
            lm_loss(cdp(x), y).backward()
            cdp.step()
        return cdp, central_step
    if name.startswith("torch-ddp"):
        model: nn.Module = nn.parallel.DistributedDataParallel(
            net, process_group=mesh.group(AXIS), gradient_as_bucket_view=name.endswith("views"))
    elif name.startswith("sw-cap="):
        model = DataParallel(net, mesh, AXIS, bucket_cap_mb=float(name.split("=")[1]))
    else:
        model = DataParallel(net, mesh, AXIS, **SW_OPTIONS[name])  # type: ignore[arg-type]
        if name == "sw-bf16":
            model.register_comm_hook(bf16_compress_hook)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    return model, step


def _run_worker(args: argparse.Namespace) -> int:
    import shardwise as sw
    from ..models.gpt import GPT

    world = sw.init()
    mesh = sw.Mesh(dp=-1)
    set_bench_threads(args.threads, world.world_size)
    names = _validate(args)
    if mesh.device.type != "cpu" and "sw-shm" in names:  # shared memory moves host tensors only
        names.remove("sw-shm")
        if world.rank == 0:
            print("bench dp: sw-shm left out: algorithm='shm' moves host memory, the ranks run on "
                  f"{mesh.device.type}", flush=True)
    cfg, batches = gpt_workload(args.preset, seq=args.seq, batch=args.batch, mesh=mesh, axis=AXIS)
    runs = {}
    for name in names:
        torch.manual_seed(0)
        runs[name] = _variant(name, GPT(cfg).to(mesh.device), mesh)
    times: dict[str, list[list[float]]] = {name: [] for name in names}  # [round][step]
    for name in names:
        time_steps(runs[name][1], batches, args.warmup)
        _reset_stats(runs[name][0])
    for _ in range(args.repeats):
        for name in names:
            sw.comm.barrier(mesh, AXIS)
            times[name].append(time_steps(runs[name][1], batches, args.steps))
    rows = _gather_rows(names, times, runs, mesh)
    if mesh.rank == 0:
        _report(rows, args, world.world_size, sum(p.numel() for p in GPT(cfg).parameters()))
    sw.shutdown()
    return 0


def _reset_stats(model: nn.Module) -> None:
    if hasattr(model, "comm_stats") and getattr(model, "_reducer", None) is not None:
        model.comm_stats(reset=True)


def _gather_rows(names: list[str], times: dict[str, list[list[float]]], runs: dict[str, tuple[nn.Module, Step]],
                 mesh: Mesh) -> list[dict[str, object]]:
    """Median step time per variant (maximum over ranks), paired ratio to torch-ddp (mean over ranks), and
    the overlap stats of each sw variant (mean over ranks)."""
    import shardwise as sw

    med = torch.tensor([statistics.median(t for r in times[n] for t in r) for n in names], dtype=torch.float64)
    ratio = torch.tensor([paired_ratio(times[n], times.get("torch-ddp")) for n in names], dtype=torch.float64)
    hidden = torch.zeros(len(names), 3, dtype=torch.float64)  # comm_ms, exposed_ms, hidden_share
    for k, name in enumerate(names):
        model = runs[name][0]
        if getattr(model, "_reducer", None) is not None:
            s = model.comm_stats().per_step()
            hidden[k] = torch.tensor([s["comm_ms"], s["exposed_ms"], s["hidden_share"]])
    sw.comm.all_reduce(med, mesh, AXIS, op="max")
    sw.comm.all_reduce(hidden, mesh, AXIS, op="avg")
    sw.comm.all_reduce(ratio, mesh, AXIS, op="avg")
    buckets = [len(runs[n][0].bucket_plan) if hasattr(runs[n][0], "bucket_plan") else None for n in names]
    return [{"variant": n, "step_ms": 1e3 * float(med[k]), "vs_ddp": float(ratio[k]) or None, "buckets": buckets[k],
             "comm_ms": float(hidden[k, 0]), "exposed_ms": float(hidden[k, 1]), "hidden_share": float(hidden[k, 2])}
            for k, n in enumerate(names)]


def _report(rows: list[dict[str, object]], args: argparse.Namespace, n: int, params: int) -> None:
    print(f"\nshardwise bench dp: {n} ranks, {args.preset} ({params / 1e6:.2f}M params, "
          f"{4 * params / 2**20:.1f} MiB of fp32 gradients), batch {args.batch}x{args.seq} per rank, "
          f"{args.repeats} rounds x {args.steps} timed steps per variant, {platform.node()}")
    print(f"{'variant':<18}{'step ms':>9}{'vs ddp':>8}{'buckets':>9}{'comm ms':>9}{'exposed':>9}{'hidden':>8}")
    for r in rows:
        ratio = f"{r['vs_ddp']:.3f}" if r["vs_ddp"] else "-"
        sw_row = r["buckets"] is not None
        print(f"{r['variant']:<18}{r['step_ms']:>9.1f}{ratio:>8}{(r['buckets'] if sw_row else '-')!s:>9}"
              + (f"{r['comm_ms']:>9.1f}{r['exposed_ms']:>9.1f}{100 * r['hidden_share']:>7.0f}%" if sw_row else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "preset": args.preset, "batch": args.batch, "seq": args.seq, "params": params,
                       "host": platform.node(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.dp",
                                      description="DataParallel step time (see `shardwise bench dp -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
