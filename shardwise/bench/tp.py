"""``shardwise bench tp``: tensor-parallel step time against torch's own tensor parallelism, eager boxing
overhead against DTensor, and the bytes of planned boxing conversions on a 2×2 mesh against a baseline.

    shardwise bench tp -n 2

(a) A stack of reference-GPT blocks (``shardwise.models.gpt.Block``) on a replicated (b, t, h) input, trained
    with SGD on ``mean(out²)``, four ways in the same run, interleaved over ``--repeats`` rounds:

        sw           sw.parallelize: QKVParallel / RowParallel / ColumnParallel / RowParallel
        sw-sp        the same with sequence parallelism (input and norms split on the sequence)
        sw-shm, sw-sp-shm   the same two with every tp collective through shared memory (``algorithm="shm"``;
                     CPU ranks on one host; left out on CUDA)
        torch        torch.distributed.tensor.parallel.parallelize_module, ColwiseParallel/RowwiseParallel
        torch-sp     the same with torch's SequenceParallel on the norms
        sw-*-async   a sw variant with ``async_tp=True`` (``--async-tp`` adds each selected one's twin); "vs sync":
                     the median over rounds of its paired ratio to the unoverlapped twin's step in the same round

    torch's ColwiseParallel cuts the fused qkv weight into naive row blocks, so its rows are first permuted to
    [q₀ k₀ v₀ | q₁ k₁ v₁ | ...] (rank r's heads contiguous): both then compute the same function, checked
    by comparing the first loss. A step's time is the median over steps, then the maximum over ranks. "comm":
    an unoverlapped variant's share of the step inside the tp collectives (``tp_async.comm_share``).
(b) Eager overhead of one boxing call (a GlobalTensor ``to_sbp``) against DTensor ``redistribute`` and the
    raw collective, on a 64×64 piece per rank.
(c) Bytes per rank of every planned conversion between 2-axis signatures on a 2×2 mesh (1024×1024 fp32)
    against the best route that changes each axis directly or through B (no intermediate splits).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn

from .harness import add_launch_arguments, run_bench
from .tp_async import add_comm_shares, async_twins
from .tp_async import sync_twin as _sync_twin

__all__ = ["add_arguments", "main"]

DEFAULT = ["sw", "sw-sp", "torch", "torch-sp", "sw-shm", "sw-sp-shm"]
VARIANTS = DEFAULT + ["sw-async", "sw-sp-async", "sw-shm-async", "sw-sp-shm-async"]


def _is_sp(name: str) -> bool:
    return "-sp" in name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, what="local ranks = tp size")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--embd", type=int, default=256, help="hidden width h (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first (default 3)")
    parser.add_argument("--repeats", type=int, default=8, help="interleaved rounds (default 8)")
    parser.add_argument("--iters", type=int, default=500, help="timed calls per boxing measurement (default 500)")
    parser.add_argument("--variants", default=",".join(DEFAULT), help="comma list of: " + ", ".join(VARIANTS)
                        + " (default: all but the -async ones; the shm ones only on CPU)")
    parser.add_argument("--async-tp", action="store_true",
                        help="add the overlapped (async_tp) twin of every selected sw variant")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")


def _validate(args: argparse.Namespace) -> list[str]:
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {VARIANTS}")
    names += async_twins(names) if getattr(args, "async_tp", False) else []
    for flag in ("nproc", "layers", "embd", "heads", "batch", "seq", "steps", "repeats", "iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.embd % args.heads or args.heads % args.nproc or args.seq % args.nproc:
        raise ValueError(f"need embd % heads == 0, heads % nproc == 0 and seq % nproc == 0; got embd={args.embd}, "
                         f"heads={args.heads}, seq={args.seq}, nproc={args.nproc}")
    return names


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("tp", args, validate=_validate, worker=_run_worker)


# -- (a) step time -----------------------------------------------------------------------------------
class Stack(nn.Module):
    """``n_layer`` reference GPT blocks: (b, t, h) → (b, t, h)."""

    def __init__(self, cfg) -> None:
        from ..models.gpt import Block

        super().__init__()
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _sw_variant(net: Stack, cfg, mesh, sp: bool, algorithm: str = "native", async_tp: bool = False) -> nn.Module:
    import shardwise as sw

    plan = {"blocks.*.attn.qkv": sw.QKVParallel(cfg.n_head), "blocks.*.attn.proj": sw.RowParallel(),
            "blocks.*.mlp.fc": sw.ColumnParallel(), "blocks.*.mlp.proj": sw.RowParallel()}
    if sp:
        plan["blocks.*.ln_*"] = sw.SequenceParallel()
    return sw.parallelize(net, mesh, plan, axis="tp", sequence_parallel=sp, algorithm=algorithm, async_tp=async_tp)


def _head_major(t: torch.Tensor, tp: int) -> torch.Tensor:
    """Fused [q | k | v] rows → [q₀ k₀ v₀ | q₁ k₁ v₁ | ...]: rank r's whole heads become one row block."""
    rest = t.shape[1:]
    return t.reshape(3, tp, -1, *rest).transpose(0, 1).reshape(t.shape).contiguous()


def _torch_variant(net: Stack, cfg, tp: int, sp: bool) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dm = init_device_mesh(device, (tp,))
    plan: dict[str, object] = {}
    for i, block in enumerate(net.blocks):
        with torch.no_grad():
            block.attn.qkv.weight.copy_(_head_major(block.attn.qkv.weight, tp))
            if block.attn.qkv.bias is not None:
                block.attn.qkv.bias.copy_(_head_major(block.attn.qkv.bias, tp))
        block.attn.n_head = cfg.n_head // tp
        out = {"output_layouts": Shard(1)} if sp else {}
        plan.update({f"blocks.{i}.attn.qkv": ColwiseParallel(), f"blocks.{i}.attn.proj": RowwiseParallel(**out),
                     f"blocks.{i}.mlp.fc": ColwiseParallel(), f"blocks.{i}.mlp.proj": RowwiseParallel(**out)})
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({f"blocks.{i}.ln_1": SequenceParallel(), f"blocks.{i}.ln_2": SequenceParallel(),
                         f"blocks.{i}.attn": gather, f"blocks.{i}.mlp": gather})
    return parallelize_module(net, dm, plan)


Step = Callable[[], float]


def _make_step(model: nn.Module, x: torch.Tensor, sp: bool, mesh) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    n, c = mesh.size("tp"), mesh.coord("tp")
    t_r = x.size(1) // n
    inp = x[:, c * t_r:(c + 1) * t_r].contiguous() if sp else x

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        out = model(inp)
        out = out.to_local() if hasattr(out, "to_local") else out
        loss = out.pow(2).sum() / x.numel()  # with SP a partial sum of the mean; the gradient is the same
        loss.backward()
        opt.step()
        return loss.detach().item()
    return step


def _time_steps(step: Step, count: int, cuda: bool) -> list[float]:
    out = []
    for _ in range(count):
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def _step_rows(args: argparse.Namespace, mesh, names: list[str]) -> tuple[list[dict[str, object]], float]:
    import shardwise as sw
    from ..models.gpt import GPTConfig

    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd, dropout=0.0)
    x = torch.randn(args.batch, args.seq, args.embd, generator=torch.Generator().manual_seed(0)).to(mesh.device)
    tp, steps = mesh.size("tp"), {}
    if mesh.device.type != "cpu":  # shared memory moves host tensors only
        names = [n for n in names if "-shm" not in n]
    for name in names:
        torch.manual_seed(0)
        net = Stack(cfg).to(mesh.device)
        algorithm = "shm" if "-shm" in name else "native"
        model = (_sw_variant(net, cfg, mesh, _is_sp(name), algorithm, _sync_twin(name) is not None)
                 if name.startswith("sw")
                 else _torch_variant(net, cfg, tp, _is_sp(name)))
        steps[name] = _make_step(model, x, _is_sp(name), mesh)
    first = {name: steps[name]() for name in names}  # also a warm-up step
    check = abs(first["sw"] - first["torch"]) if {"sw", "torch"} <= set(names) else float("nan")
    for name in names:
        _time_steps(steps[name], args.warmup, x.is_cuda)
    # per round and variant: the median step; then the maximum over ranks (the slowest rank sets the pace)
    rounds = torch.zeros(args.repeats, len(names), dtype=torch.float64)
    for r in range(args.repeats):
        for k, name in enumerate(names):
            sw.comm.barrier(mesh, "tp")
            rounds[r, k] = statistics.median(_time_steps(steps[name], args.steps, x.is_cuda))
    sw.comm.all_reduce(rounds, mesh, "tp", op="max")
    rows = [_row(n, k, names, rounds) for k, n in enumerate(names)]
    add_comm_shares(rows, steps, args.steps, mesh, x.is_cuda)
    return rows, check


def _row(name: str, k: int, names: list[str], rounds: torch.Tensor) -> dict[str, object]:
    """Median step over rounds, and the median over rounds of the paired ratio against torch's variant of
    the same mode in the same round (cancels slow load drift on a shared machine)."""
    base = "torch-sp" if _is_sp(name) else "torch"
    ratios = (rounds[:, k] / rounds[:, names.index(base)]).tolist() if base in names else []
    twin = _sync_twin(name)
    vs_sync = (rounds[:, k] / rounds[:, names.index(twin)]).tolist() if twin in names else []
    return {"variant": name, "step_ms": 1e3 * statistics.median(rounds[:, k].tolist()),
            "vs_torch": statistics.median(ratios) if ratios else float("nan"),
            "vs_torch_range": [min(ratios), max(ratios)] if ratios else [],
            "vs_sync": statistics.median(vs_sync) if vs_sync else float("nan"),
            "vs_sync_range": [min(vs_sync), max(vs_sync)] if vs_sync else []}


# -- (b) boxing overhead ---------------------------------------------------------------------------
def _time_call(fn: Callable[[], object], iters: int, mesh) -> float:
    import shardwise as sw

    for _ in range(min(20, iters)):
        fn()
    sw.comm.barrier(mesh, "tp")
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if mesh.device.type == "cuda":
        torch.cuda.synchronize()
    us = torch.tensor([(time.perf_counter() - t0) / iters * 1e6], dtype=torch.float64)
    sw.comm.all_reduce(us, mesh, "tp", op="max")
    return float(us)


def _best_of(fns: list[Callable[[], object]], iters: int, mesh, rounds: int = 3) -> list[float]:
    """Each fn's mean µs per call, measured in interleaved rounds (a load spike hits all alike), best round."""
    best = [math.inf] * len(fns)
    for _ in range(rounds):
        for k, fn in enumerate(fns):
            best[k] = min(best[k], _time_call(fn, iters, mesh))
    return best


def _boxing_rows(mesh, iters: int) -> list[tuple[str, float, float, float]]:
    """(conversion, raw collective µs, shardwise µs, DTensor µs) on a 64×64 fp32 piece per rank."""
    import shardwise as sw
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    n, dev = mesh.size("tp"), mesh.device
    dm = init_device_mesh(dev.type, (n,))
    piece = torch.randn(64, 64, device=dev)
    full = torch.randn(64 * n, 64, device=dev)
    g_s, g_p, g_b = sw.to_global(piece, mesh, "S(0)"), sw.to_global(piece, mesh, "P"), sw.to_global(full, mesh, "B")
    d_s = DTensor.from_local(piece, dm, [Shard(0)])
    d_p, d_b = DTensor.from_local(piece, dm, [Partial()]), DTensor.from_local(full, dm, [Replicate()])
    cases = {
        "S(0) -> B  all-gather": (lambda: sw.comm.all_gather(piece, mesh, "tp"), lambda: g_s.to_sbp("B"),
                                  lambda: d_s.redistribute(dm, [Replicate()])),
        "P -> B     all-reduce": (lambda: sw.comm.all_reduce(piece.clone(), mesh, "tp"), lambda: g_p.to_sbp("B"),
                                  lambda: d_p.redistribute(dm, [Replicate()])),
        "P -> S(0)  reduce-scatter": (lambda: sw.comm.reduce_scatter(piece, mesh, "tp"),
                                      lambda: g_p.to_sbp("S(0)"), lambda: d_p.redistribute(dm, [Shard(0)])),
        "B -> S(0)  local slice": (lambda: full.narrow(0, 0, 64).contiguous(), lambda: g_b.to_sbp("S(0)"),
                                   lambda: d_b.redistribute(dm, [Shard(0)])),
    }
    return [(name, *_best_of(list(fns), iters, mesh)) for name, fns in cases.items()]


# -- (c) boxing bytes on a 2x2 mesh ----------------------------------------------------------------
def _ring_bytes(src, dst, n: int, local: float) -> float | None:
    """Bytes one rank sends for a direct one-axis conversion (bandwidth-optimal ring collectives), None when
    there is no single collective for the pair."""
    from ..sbp.placement import Replicate, Partial, Split

    if src == dst:
        return 0.0
    if isinstance(src, Split):
        return {Replicate: (n - 1) * local, Split: (n - 1) / n * local, Partial: 0.0}[type(dst)]
    if isinstance(src, Replicate):
        return 0.0
    return {Replicate: 2 * (n - 1) / n * local, Split: (n - 1) / n * local}.get(type(dst))


def _baseline(shape, src, dst, mesh_shape) -> float:
    """Cheapest route that moves every axis straight to its target or through B, in any order, respecting
    split nesting (a split of dim d changes on axis a only while no inner axis splits d)."""
    from ..sbp.placement import Replicate, Split

    B = Replicate()
    routes = [[(a, p) for p in ([dst[a]] if via == 0 else [B, dst[a]])] for a, via in
              itertools.product(range(len(src)), (0, 1))]
    best = math.inf
    for choice in itertools.product((0, 1), repeat=len(src)):
        moves = [m for a in range(len(src)) for m in routes[2 * a + choice[a]]]
        for order in itertools.permutations(moves):
            state, cost, ok = list(src), 0.0, True
            pending = {a: [p for (b, p) in order if b == a] for a in range(len(src))}
            for a, p in order:
                if p != pending[a][0]:
                    ok = False
                    break
                pending[a].pop(0)
                if state[a] == p:
                    continue
                if any(isinstance(q, Split) and q in state[a + 1:] for q in (state[a], p)):
                    ok = False
                    break
                local = 4 * math.prod(shape) / math.prod(n for q, n in zip(state, mesh_shape) if isinstance(q, Split))
                step = _ring_bytes(state[a], p, mesh_shape[a], local)
                if step is None:
                    ok = False
                    break
                cost, state[a] = cost + step, p
            if ok and tuple(state) == tuple(dst):
                best = min(best, cost)
    return best


def _bytes_rows() -> list[tuple[str, str, int, float]]:
    from ..sbp.boxing import route_boxing
    from ..sbp.placement import Replicate, Partial, Split

    shape, mesh_shape = (1024, 1024), (2, 2)
    sigs = list(itertools.product([Split(0), Split(1), Replicate(), Partial()], repeat=2))
    rows = []
    for src, dst in itertools.product(sigs, repeat=2):
        plan = route_boxing(shape, 4, src, dst, mesh_shape, ("dp", "tp"))
        rows.append((",".join(map(str, src)), ",".join(map(str, dst)), plan.bytes_sent, _baseline(shape, src, dst, mesh_shape)))
    return rows


# -- worker ----------------------------------------------------------------------------------------
def _run_worker(args: argparse.Namespace) -> int:
    import shardwise as sw

    world = sw.init()
    mesh = sw.Mesh(tp=-1)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // max(1, world.world_size)))
    names = _validate(args)
    rows, check = _step_rows(args, mesh, names)
    boxing = _boxing_rows(mesh, args.iters)
    if mesh.rank == 0:
        _report(args, world.world_size, rows, check, boxing, _bytes_rows())
    sw.shutdown()
    return 0


def _report(args, n: int, rows, check: float, boxing, bytes_rows) -> None:
    print(f"\nshardwise bench tp: tp={n}, {args.layers} blocks h={args.embd} heads={args.heads}, batch "
          f"{args.batch}x{args.seq}, {args.repeats}x{args.steps} timed steps, torch {torch.__version__}, "
          f"{platform.node()}; |loss(sw) - loss(torch)| at step 1 = {check:.2e}")
    print(f"{'variant':<16}{'step ms':>9}{'vs torch':>10}{'vs sync':>9}{'comm':>7}  paired ratios per round: "
          f"min-max")
    for r in rows:
        span = "-".join(f"{x:.3f}" for x in r["vs_torch_range"] or r["vs_sync_range"])
        print(f"{r['variant']:<16}{r['step_ms']:>9.2f}{r['vs_torch']:>10.3f}{r['vs_sync']:>9.3f}"
              f"{r['comm_share']:>7.2f}  {span}")
    print(f"\n{'boxing (64x64 fp32 per rank)':<28}{'raw us':>9}{'sw us':>9}{'DTensor us':>11}{'sw extra':>10}"
          f"{'DT extra':>10}")
    for name, raw, ours, theirs in boxing:
        print(f"{name:<28}{raw:>9.1f}{ours:>9.1f}{theirs:>11.1f}{ours - raw:>10.1f}{theirs - raw:>10.1f}")
    worse = [r for r in bytes_rows if r[2] > r[3]]
    better = [r for r in bytes_rows if r[2] < r[3]]
    print(f"\nboxing bytes on a 2x2 mesh (1024x1024 fp32, bytes sent per rank): {len(bytes_rows)} pairs; planner "
          f"= baseline on {len(bytes_rows) - len(worse) - len(better)}, below it on {len(better)}, above on {len(worse)}")
    print(f"{'from':<10}{'to':<10}{'planned':>10}{'baseline':>10}")
    for src, dst, planned, base in (worse + better + [r for r in bytes_rows if r[0] in ("P,P", "S(0),S(1)")])[:40]:
        print(f"{src:<10}{dst:<10}{planned:>10d}{base:>10.0f}")
    if args.json:
        with open(args.json, "w") as f:
            plain = {k: v for k, v in vars(args).items() if not k.startswith("_")}  # not the parser object
            json.dump({"tp": n, "args": plain, "steps": rows, "loss_check": check, "boxing": boxing,
                       "bytes": bytes_rows, "host": platform.node()}, f, indent=1)


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.tp",
                                      description="tensor-parallel benchmark (see `shardwise bench tp -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
