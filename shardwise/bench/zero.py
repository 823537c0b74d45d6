"""``shardwise bench zero``: step time and memory of ``sw.zero`` stages against torch's FSDP2 and ZeRO-1.

``shardwise bench zero -n 2`` starts 2 local ranks through torchrun (``run_local``) that re-run this module
with ``--worker``. Every rank builds the reference GPT and these variants of it (AdamW everywhere):

    fsdp2          torch.distributed.fsdp.fully_shard on every block, then on the root (FSDP2, ZeRO-3 like)
    torch-zero1    DDP + torch.distributed.optim.ZeroRedundancyOptimizer (sharded optimizer state)
    sw-zero1/2/3   sw.zero(stage=1|2|3) with its defaults (25 MB buckets reduce-scattered during backward,
                   ring collectives on CPU, native on CUDA; blocks as stage-3 units)
    *-bf16         (opt-in) fsdp2 with MixedPrecisionPolicy(param_dtype=bf16) and sw-zero3 with
                   MixedPrecision(param_dtype=bf16): bf16 compute, fp32 master weights and AdamW state
    sw-zero*-shm   (opt-in) sw.zero(algorithm="shm"): reduce-scatters and all-gathers through shared memory

Two phases. Memory: one variant at a time (built, trained ``--warmup`` steps, measured after the next
backward, then deleted): ``state MiB`` is this rank's parameter + gradient + optimizer-state storage
(each storage once, DTensors by their local shards; DDP's own bucket buffers are not visible and not
counted), ``peak MiB`` (CUDA only) the allocator's high-water mark during that variant's steps. Time: all
variants built, then ``--repeats`` interleaved rounds of ``--steps`` timed steps each, so machine load hits
them alike. ``step ms`` is the median step (maximum over ranks); ``vs fsdp2`` the median over rounds of
the paired ratio to fsdp2's median step of the same round. Rank 0 prints the table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import platform
import statistics
from typing import Any, Callable

import torch
import torch.nn as nn

from .harness import add_launch_arguments, paired_ratio, run_bench
from .steps import gpt_workload, set_bench_threads, time_steps

__all__ = ["add_arguments", "main"]

AXIS = "dp"
BASE = ["fsdp2", "torch-zero1", "sw-zero1", "sw-zero2", "sw-zero3"]
EXTRA = ["fsdp2-bf16", "sw-zero3-bf16",  # bf16 compute, fp32 master/state: opt in with --variants
         "sw-zero1-shm", "sw-zero2-shm", "sw-zero3-shm"]  # collectives through shared memory (CPU, one host)
Step = Callable[[torch.Tensor, torch.Tensor], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser)
    parser.add_argument("--preset", default="gpt-small", help="GPT preset (default gpt-small, ~3.3M params)")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    parser.add_argument("--repeats", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--variants", default=",".join(BASE), help="comma list of: " + ", ".join(BASE + EXTRA))
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")


def _validate(args: argparse.Namespace) -> list[str]:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in BASE + EXTRA]
    if unknown or not names:
        raise ValueError(f"unknown or no variants {unknown or names}; choose from {BASE + EXTRA}")
    for flag in ("nproc", "batch", "seq", "steps", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    return names


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("zero", args, validate=_validate, worker=_run_worker)


# -- inside a rank ----------------------------------------------------------------------------------
def _adamw() -> Any:
    return functools.partial(torch.optim.AdamW, lr=1e-4)


def _variant(name: str, net: nn.Module, mesh: Any) -> tuple[nn.Module, Any, Step]:
    """Wrap ``net`` as variant ``name``; return (model, optimizer, one training step)."""
    import shardwise as sw
    from ..models.gpt import lm_loss

    bf16 = name.endswith("-bf16")
    if name.startswith("sw-zero"):
        mp = sw.MixedPrecision(param_dtype=torch.bfloat16) if bf16 else None
        model, opt = sw.zero(net, mesh, stage=int(name.split("-")[1][-1]), optimizer=_adamw(), axis=AXIS,
                             mixed_precision=mp, algorithm="shm" if name.endswith("-shm") else None)
    elif name.startswith("fsdp2"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        dmesh = DeviceMesh.from_group(mesh.group(AXIS), mesh.device.type)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        for block in net.blocks:
            fully_shard(block, mesh=dmesh, mp_policy=policy)
        model = fully_shard(net, mesh=dmesh, mp_policy=policy)
        opt = _adamw()(model.parameters())
    else:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        model = nn.parallel.DistributedDataParallel(net, process_group=mesh.group(AXIS))
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                      process_group=mesh.group(AXIS), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        lm_loss(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, step


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _state_bytes(model: nn.Module, opt: Any) -> int:
    """Parameter + gradient + optimizer-state storage of this rank, each storage once."""
    import shardwise as sw
    from ..parallel.common.memory import storage_bytes

    if hasattr(model, "memory_tensors"):
        r = sw.memory_report(model, opt)
        return r["params"] + r["grads"] + r["optimizer"]
    params = [_local(p) for p in model.parameters()]
    grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
    inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps its shard's optimizer in .optim
    state = [_local(v) for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return sum(storage_bytes({"params": params, "grads": grads, "optimizer": state}).values())


def _measure_memory(name: str, build: Callable[[], nn.Module], mesh: Any, batches: list, warmup: int) -> tuple[float, float]:
    """(state MiB after a backward, CUDA peak MiB or nan) of one variant built alone."""
    from ..models.gpt import lm_loss

    cuda = mesh.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(mesh.device)
    model, opt, step = _variant(name, build(), mesh)
    for k in range(max(1, warmup)):
        step(*batches[k % len(batches)])
    lm_loss(model(batches[0][0]).float(), batches[0][1]).backward()
    state = _state_bytes(model, opt) / 2**20
    opt.step()
    opt.zero_grad()
    peak = torch.cuda.max_memory_allocated(mesh.device) / 2**20 if cuda else float("nan")
    del model, opt, step
    gc.collect()
    return state, peak


def _run_worker(args: argparse.Namespace) -> int:
    import shardwise as sw
    from ..models.gpt import GPT

    world = sw.init()
    mesh = sw.Mesh(dp=-1)
    set_bench_threads(args.threads, world.world_size)
    names = _validate(args)
    cfg, batches = gpt_workload(args.preset, seq=args.seq, batch=args.batch, mesh=mesh, axis=AXIS)

    def build() -> nn.Module:
        torch.manual_seed(0)
        return GPT(cfg).to(mesh.device)
    memory = {name: _measure_memory(name, build, mesh, batches, args.warmup) for name in names}
    runs = {name: _variant(name, build(), mesh) for name in names}
    times: dict[str, list[list[float]]] = {name: [] for name in names}  # [round][step]
    for name in names:
        time_steps(runs[name][2], batches, args.warmup)
    for _ in range(args.repeats):
        for name in names:
            sw.comm.barrier(mesh, AXIS)
            times[name].append(time_steps(runs[name][2], batches, args.steps))
    rows = _gather_rows(names, times, memory, mesh)
    if mesh.rank == 0:
        _report(rows, args, world.world_size, sum(p.numel() for p in build().parameters()), mesh.device.type)
    sw.shutdown()
    return 0


def _gather_rows(names: list[str], times: dict[str, list[list[float]]], memory: dict[str, tuple[float, float]],
                 mesh: Any) -> list[dict[str, Any]]:
    """Median step (max over ranks), paired ratio to fsdp2 (mean over ranks), memory (max over ranks)."""
    import shardwise as sw

    def reduced(values: list, op: str) -> torch.Tensor:
        # On the mesh's device (NCCL reduces CUDA tensors only), read back on the host.
        t = torch.tensor(values, dtype=torch.float64, device=mesh.device)
        return sw.comm.all_reduce(t, mesh, AXIS, op=op).cpu()  # type: ignore[union-attr]

    med = reduced([statistics.median(t for r in times[n] for t in r) for n in names], "max")
    ratio = reduced([paired_ratio(times[n], times.get("fsdp2")) for n in names], "avg")
    mem = reduced([list(memory[n]) for n in names], "max")
    ref = {n: k for k, n in enumerate(names)}.get("fsdp2")
    return [{"variant": n, "step_ms": 1e3 * float(med[k]), "vs_fsdp2": float(ratio[k]) or None,
             "state_mib": float(mem[k, 0]), "peak_mib": float(mem[k, 1]),
             "state_vs_fsdp2": float(mem[k, 0] / mem[ref, 0]) if ref is not None else None}
            for k, n in enumerate(names)]


def _report(rows: list[dict[str, Any]], args: argparse.Namespace, n: int, params: int, device: str) -> None:
    print(f"\nshardwise bench zero: {n} ranks ({device}), {args.preset} ({params / 1e6:.2f}M params), batch "
          f"{args.batch}x{args.seq} per rank, AdamW (fp32 unless -bf16), {args.repeats} rounds x {args.steps} timed steps per "
          f"variant, {platform.node()}")
    print(f"{'variant':<14}{'step ms':>9}{'vs fsdp2':>10}{'state MiB':>11}{'vs fsdp2':>10}{'peak MiB':>10}")
    for r in rows:
        ratio = f"{r['vs_fsdp2']:.3f}" if r["vs_fsdp2"] else "-"
        mratio = f"{r['state_vs_fsdp2']:.2f}" if r["state_vs_fsdp2"] else "-"
        peak = "-" if r["peak_mib"] != r["peak_mib"] else f"{r['peak_mib']:.1f}"
        print(f"{r['variant']:<14}{r['step_ms']:>9.1f}{ratio:>10}{r['state_mib']:>11.2f}{mratio:>10}{peak:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": n, "preset": args.preset, "batch": args.batch, "seq": args.seq, "params": params,
                       "device": device, "host": platform.node(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.zero",
                                      description="ZeRO step time and memory (see `shardwise bench zero -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
