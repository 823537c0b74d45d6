"""``shardwise bench moe``: mixtures of experts, two parts (``--part grouped|ep|all``).

    shardwise bench moe --part grouped            # one process
    shardwise bench moe --part ep -n 4            # 4 local ranks, ep 4

(a) ``grouped``: one MoE block's forward + backward with the experts as grouped matmuls (``F.grouped_mm``) against
    one matmul per expert, at ``--experts`` counts, tokens and widths fixed (``moe_grouped.py``). Runs in this
    process on ``--threads`` threads (0: every core, as one rank would).
(b) ``ep``: a training step (forward, backward, gradient averaging, AdamW) of an MoE GPT under expert
    parallelism over ``-n`` local ranks (ep = ``--ep``, default all of them, folded into data parallelism): our
    route against transformers' ``AllToAllEP`` on the same model, weights, tokens and ranks (``moe_peer.py``).
    Variants run in interleaved rounds; ``step ms`` is the median over a variant's timed steps, the maximum over
    ranks; ``vs hf`` the median over rounds of the paired ratio to the hf variant's step in the same round.

Rank 0 prints the tables; ``--json`` gets both parts.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .harness import add_launch_arguments, paired_ratio, run_bench
from .steps import set_bench_threads, time_steps

__all__ = ["add_arguments", "main"]

PARTS = ("grouped", "ep", "all")
VARIANTS = ("sw", "sw-pairwise", "hf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, nproc=4, what="local ranks of part ep")
    parser.add_argument("--part", choices=PARTS, default="all", help="grouped, ep or all (default all)")
    parser.add_argument("--experts", default="8,16,32,64", help="(a) expert counts (default 8,16,32,64)")
    parser.add_argument("--tokens", type=int, default=2048, help="(a) tokens through the block (default 2048)")
    parser.add_argument("--hidden", type=int, default=256, help="(a) hidden width (default 256)")
    parser.add_argument("--ffn", type=int, default=256, help="(a) expert width (default 256)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token, both parts (default 2)")
    parser.add_argument("--ep", type=int, default=0, help="(b) expert-parallel ranks (0: all -n ranks)")
    parser.add_argument("--n-experts", type=int, default=16, help="(b) experts per MoE layer (default 16)")
    parser.add_argument("--layers", type=int, default=2, help="(b) transformer blocks, all MoE (default 2)")
    parser.add_argument("--embd", type=int, default=128, help="(b) hidden width (default 128)")
    parser.add_argument("--moe-ffn", type=int, default=128, help="(b) expert width (default 128)")
    parser.add_argument("--batch", type=int, default=4, help="(b) sequences per rank per step (default 4)")
    parser.add_argument("--seq", type=int, default=128, help="(b) tokens per sequence (default 128)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="(b) comma list of: " + ", ".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default 2)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: cores, shared by the ranks)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--ep-json", default=None, help=argparse.SUPPRESS)  # rank 0 of part ep → the launcher


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated ints, got {text!r}; e.g. {flag} 8,16") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} must be ints >= 1, got {text!r}; e.g. {flag} 8,16")
    return values


def _validate(args: argparse.Namespace) -> list[str]:
    """The variants of part ep; one-line ValueErrors for every bad flag."""
    for flag in ("tokens", "hidden", "ffn", "top_k", "n_experts", "layers", "embd", "moe_ffn", "batch", "seq",
                 "steps", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.warmup < 0 or args.threads < 0 or args.ep < 0:
        raise ValueError(f"--warmup, --threads and --ep must be >= 0, got {args.warmup}, {args.threads}, {args.ep}")
    experts = _ints(args.experts, "--experts")
    if args.part in ("grouped", "all") and args.top_k > min(experts):
        raise ValueError(f"--top-k {args.top_k} is above the smallest of --experts {args.experts}; lower it")
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise ValueError(f"unknown variants {unknown or names}; choose from {list(VARIANTS)}")
    if args.part in ("ep", "all"):
        ep = args.ep or args.nproc
        if args.nproc % ep or args.n_experts % ep:
            raise ValueError(f"--ep {ep} must divide both -n {args.nproc} and --n-experts {args.n_experts}")
        if args.top_k > args.n_experts:
            raise ValueError(f"--top-k {args.top_k} is above --n-experts {args.n_experts}; lower it")
    return names


def main(args: argparse.Namespace) -> int:
    """Part (a) here, part (b) on ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    if args.worker:
        return run_bench("moe", args, validate=_validate, worker=_run_worker)
    try:
        _validate(args)
    except ValueError as exc:
        print(f"shardwise bench moe: error: {exc}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"host": platform.node(), "args": _plain_args(args)}
    if args.part in ("grouped", "all"):
        from .moe_grouped import grouped_rows, measure_grouped

        set_bench_threads(args.threads, 1)
        results["grouped"] = measure_grouped(_ints(args.experts, "--experts"), tokens=args.tokens, top_k=args.top_k,
                                             hidden=args.hidden, ffn=args.ffn, warmup=args.warmup, steps=args.steps,
                                             repeats=args.repeats)
        print(grouped_rows(results["grouped"], torch.get_num_threads()), flush=True)
    if args.part in ("ep", "all"):
        with tempfile.TemporaryDirectory(prefix="shardwise-bench-moe-") as tmp:
            args.ep_json = str(Path(tmp) / "ep.json")
            rc = run_bench("moe", args, validate=_validate, worker=_run_worker)
            if rc != 0:
                return rc
            results["ep"] = json.loads(Path(args.ep_json).read_text())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def _plain_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in ("worker", "ep_json")}


# -- part (b), inside a rank --------------------------------------------------------------------------------
def _run_worker(args: argparse.Namespace) -> int:
    import shardwise as sw

    world = sw.init()
    set_bench_threads(args.threads, world.world_size)
    names = _validate(args)
    ep = args.ep or world.world_size
    if "hf" in names:
        from .moe_peer import peer_available

        why = peer_available()
        if why:
            names.remove("hf")
            if world.rank == 0:
                print(f"bench moe: hf left out: {why}", flush=True)
    mesh = sw.Mesh(dp=-1)
    emesh = sw.Mesh(edp=world.world_size // ep, ep=ep, one=1)
    rows, losses = _measure(args, names, mesh, emesh)
    if mesh.rank == 0:
        out = _report(rows, losses, args, world.world_size, ep)
        if args.ep_json:
            Path(args.ep_json).write_text(json.dumps(out, indent=1))
    sw.shutdown()
    return 0


def _config(args: argparse.Namespace) -> Any:
    from ..models.gpt import GPTConfig

    return GPTConfig(vocab_size=512, block_size=args.seq, n_layer=args.layers, n_head=max(1, args.embd // 32),
                     n_embd=args.embd, n_experts=args.n_experts, top_k=args.top_k, moe_ffn=args.moe_ffn,
                     moe_aux_loss_coef=0.01, bias=False)


def _build(name: str, cfg: Any, mesh: Any, emesh: Any) -> tuple[Any, Any]:
    """Variant ``name`` of the model (built from seed 0 on every rank) and its step ``(x, y) -> loss``."""
    from ..models.gpt import GPT, lm_loss
    from ..parallel.data.data_parallel import DataParallel
    from ..parallel.expert.grads import ExpertGradSync
    from ..parallel.expert.shard import expert_params, shard_experts

    torch.manual_seed(0)
    net = GPT(cfg)
    shard_experts(net, emesh, "ep", algorithm="pairwise" if name == "sw-pairwise" else "native")
    if name == "hf":
        from .moe_peer import use_peer_route

        use_peer_route(net, emesh, "ep", "one")
    model = DataParallel(net, mesh, "dp")
    experts = ExpertGradSync(expert_params(net), emesh, "edp", mesh.size("dp"))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y)
        loss.backward()
        experts.sync()
        opt.step()
        return float(loss.detach())
    return net, step


def _measure(args: argparse.Namespace, names: list[str], mesh: Any, emesh: Any) -> tuple[list[dict], dict]:
    import shardwise as sw
    from ..models.gpt import synthetic_batch

    cfg = _config(args)
    gen = torch.Generator().manual_seed(1000 + mesh.coord("dp"))
    batches = [synthetic_batch(args.batch, args.seq, cfg.vocab_size, gen) for _ in range(4)]
    runs = {name: _build(name, cfg, mesh, emesh)[1] for name in names}
    # the same weights and tokens: the same first loss; the second one also checks the gradients and the update
    first = {name: [runs[name](*batches[0]), runs[name](*batches[1])] for name in names}
    times: dict[str, list[list[float]]] = {name: [] for name in names}
    for name in names:
        time_steps(runs[name], batches, args.warmup)
    for _ in range(args.repeats):
        for name in names:
            sw.comm.barrier(mesh, "dp")
            times[name].append(time_steps(runs[name], batches, args.steps))
    med = torch.tensor([statistics.median(t for r in times[n] for t in r) for n in names], dtype=torch.float64)
    ref = times.get("hf")
    ratio = torch.tensor([paired_ratio(times[n], ref) for n in names], dtype=torch.float64)
    sw.comm.all_reduce(med, mesh, "dp", op="max")
    sw.comm.all_reduce(ratio, mesh, "dp", op="avg")
    rows = [{"variant": n, "step_ms": 1e3 * float(med[k]), "vs_hf": float(ratio[k]) or None}
            for k, n in enumerate(names)]
    return rows, first


def _report(rows: list[dict], losses: dict, args: argparse.Namespace, n: int, ep: int) -> dict[str, Any]:
    from ..models.gpt import GPT

    cfg = _config(args)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    spread = max(max(v[i] for v in losses.values()) - min(v[i] for v in losses.values()) for i in range(2))
    print(f"\n(b) expert parallelism: {n} ranks, ep {ep}, GPT {args.layers} MoE layers, hidden {args.embd}, "
          f"{args.n_experts} experts (width {args.moe_ffn}) top-{args.top_k}, {params / 1e6:.2f}M params, batch "
          f"{args.batch}x{args.seq} per rank, {args.repeats} rounds x {args.steps} steps, {torch.get_num_threads()} "
          f"thread(s) per rank")
    print(f"{'variant':<14}{'step ms':>9}{'vs hf':>8}")
    for r in rows:
        print(f"{r['variant']:<14}{r['step_ms']:>9.1f}{(format(r['vs_hf'], '.3f') if r['vs_hf'] else '-'):>8}")
    print(f"losses of the first two steps (rank 0): {'; '.join(f'{k} {v[0]:.6f}, {v[1]:.6f}' for k, v in losses.items())}"
          f" (largest spread {spread:.1e})")
    out: dict[str, Any] = {"ranks": n, "ep": ep, "params": params, "rows": rows, "first_losses": losses,
                           "loss_spread": spread, "config": cfg.to_dict()}
    if "hf" in losses:
        from .moe_peer import describe_peer

        out["versions"] = describe_peer()
    return out


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.moe",
                                      description="mixtures of experts (see `shardwise bench moe -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
