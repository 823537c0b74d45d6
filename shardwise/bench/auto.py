"""``shardwise bench auto``: ``sw.auto``'s plan against the hand-written Megatron plan on the same model, and how
long tracing and planning take on a 32-layer model.

    shardwise bench auto -n 2                    # reference GPT (its own Megatron plan)
    shardwise bench auto -n 2 --model llama      # transformers LlamaForCausalLM from a config (no download)

(a) The model is built twice from one seed; ``auto`` is ``sw.parallelize(model, mesh, sw.auto(model, mesh,
    (ids,)))`` and ``megatron`` the hand-written plan (GPT: ``GPTConfig.tensor_parallel_plan()``; Llama: column
    q/k/v/gate/up with whole heads, row o/down, vocabulary-parallel embedding and head). One training step =
    forward, cross-entropy (vocabulary-parallel when the head is split), backward, SGD. The variants alternate
    over ``--repeats`` rounds; a step's time is the median of ``--steps``, then the maximum over ranks; the
    ratio is the median over rounds of auto / megatron in the same round. Collectives of one step are counted
    (``CommCounter``) for each.
(b) On rank 0: ``trace_graph`` alone and the whole ``sw.auto`` (trace + prices + exact search + the table of
    rejected alternatives) for a ``--plan-layers``-layer model of the same width; the median of 3.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .harness import add_launch_arguments, run_bench

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, what="local ranks = tp size")
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt", help="model family (default gpt)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    parser.add_argument("--embd", type=int, default=512, help="hidden width h (default 512)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--vocab", type=int, default=1024, help="vocabulary (default 1024)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant per round (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--plan-layers", type=int, default=32, help="layers of the planning-time model (default 32)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cores / ranks)")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")


def _validate(args: argparse.Namespace) -> None:
    for name in ("layers", "embd", "heads", "vocab", "batch", "seq", "steps", "repeats", "plan_layers"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.batch % args.nproc:
        raise ValueError(f"--batch {args.batch} must be a multiple of -n {args.nproc} (a data-parallel plan splits it)")
    if args.embd % args.heads:
        raise ValueError(f"--embd {args.embd} must be a multiple of --heads {args.heads}")
    if args.model == "llama":
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ValueError("--model llama needs transformers (pip install 'shardwise[dev]'); or use --model gpt") from None


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("auto", args, validate=_validate, worker=_run_worker)


def _builder(args: argparse.Namespace, layers: int) -> tuple[Callable[[], nn.Module], dict[str, Any]]:
    """A zero-argument model builder and the model's hand-written Megatron plan."""
    import shardwise as sw

    if args.model == "gpt":
        from ..models.gpt import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=args.heads,
                        n_embd=args.embd, dropout=0.0)
        return (lambda: GPT(cfg)), cfg.tensor_parallel_plan()
    from transformers import LlamaConfig, LlamaForCausalLM

    kv = max(1, args.heads // 2)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.embd, intermediate_size=2 * args.embd,
                      num_hidden_layers=layers, num_attention_heads=args.heads, num_key_value_heads=kv,
                      max_position_embeddings=args.seq)
    attn, mlp = "model.layers.*.self_attn.", "model.layers.*.mlp."
    plan = {"model.embed_tokens": sw.VocabParallel(), "lm_head": sw.VocabParallel(),
            attn + "q_proj": sw.ColumnParallel(heads=args.heads), attn + "k_proj": sw.ColumnParallel(heads=kv),
            attn + "v_proj": sw.ColumnParallel(heads=kv), attn + "o_proj": sw.RowParallel(),
            mlp + "gate_proj": sw.ColumnParallel(), mlp + "up_proj": sw.ColumnParallel(),
            mlp + "down_proj": sw.RowParallel()}
    return (lambda: LlamaForCausalLM(cfg)), plan


def _step(model: nn.Module, ids: torch.Tensor, vocab_split: bool, mesh: Any) -> Callable[[], float]:
    """One SGD step on ``ids`` (this rank's rows of the global batch)."""
    from ..parallel.tensor.apply_plan import vocab_parallel_cross_entropy

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = ids[:, :-1], ids[:, 1:]

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        out = model(x)
        logits = out.logits if hasattr(out, "logits") else out
        if vocab_split:
            loss = vocab_parallel_cross_entropy(logits, y, mesh=mesh, axis="tp")
        else:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach().item()
    return step


def _variants(args: argparse.Namespace, mesh: Any) -> tuple[dict[str, Callable[[], float]], dict[str, Any]]:
    import shardwise as sw
    from ..parallel.tensor.styles import VocabParallel

    build, megatron = _builder(args, args.layers)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    model = build()
    plan = sw.auto(model, mesh, (ids[:, :-1],))
    if plan.tp_axis is None:  # pure data parallelism: each rank steps on its rows of the same global batch
        n, c = mesh.size("tp"), mesh.coord("tp")
        steps = {"auto": _step(sw.DataParallel(model, mesh, axis="tp"), ids[c * args.batch // n:(c + 1) * args.batch // n],
                               False, mesh)}
    else:
        steps = {"auto": _step(sw.parallelize(model, mesh, plan), ids, plan.vocab_parallel_loss, mesh)}
    torch.manual_seed(0)
    head_split = any(isinstance(s, VocabParallel) and p.endswith("lm_head") for p, s in megatron.items())
    steps["megatron"] = _step(sw.parallelize(build(), mesh, megatron, axis="tp"), ids, head_split, mesh)
    info = {"same_plan": dict(plan) == megatron, "auto_plan": {k: repr(v) for k, v in plan.items()},
            "megatron_plan": {k: repr(v) for k, v in megatron.items()}, "printed": str(plan)}
    return steps, info


def _time(step: Callable[[], float], count: int) -> list[float]:
    out = []
    for _ in range(count):
        t = time.perf_counter()
        step()
        out.append(time.perf_counter() - t)
    return out


def _measure(args: argparse.Namespace, mesh: Any, steps: dict[str, Callable[[], float]]) -> dict[str, Any]:
    import shardwise as sw
    from ..comm import CommCounter

    first, counts = {}, {}
    for name, step in steps.items():
        with CommCounter() as c:
            first[name] = step()
        counts[name] = c.by_op()
    rounds = torch.zeros(args.repeats, len(steps), dtype=torch.float64)
    order = list(enumerate(steps.values()))
    for r in range(args.repeats):
        for k, step in order if r % 2 == 0 else order[::-1]:  # alternate who goes first: no order bias
            sw.comm.barrier(mesh, "tp")
            rounds[r, k] = statistics.median(_time(step, args.steps))
    sw.comm.all_reduce(rounds, mesh, "tp", op="max")
    ratios = (rounds[:, 0] / rounds[:, 1]).tolist()
    return {"step_ms": {n: 1e3 * statistics.median(rounds[:, k].tolist()) for k, n in enumerate(steps)},
            "auto_vs_megatron": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "collectives_per_step": counts, "first_loss": first}


def _planning_time(args: argparse.Namespace, mesh: Any) -> dict[str, float]:
    import shardwise as sw
    from ..parallel.auto.trace import trace_graph

    build, _ = _builder(args, args.plan_layers)
    torch.manual_seed(0)
    model = build()
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    trace, total = [], []
    for _ in range(3):
        t = time.perf_counter()
        graph = trace_graph(model, (ids,))
        trace.append(time.perf_counter() - t)
        t = time.perf_counter()
        sw.auto(model, mesh, (ids,))
        total.append(time.perf_counter() - t)
    return {"layers": args.plan_layers, "nodes": len(graph.nodes), "trace_s": statistics.median(trace),
            "auto_s": statistics.median(total)}


def _run_worker(args: argparse.Namespace) -> int:
    import shardwise as sw

    world = sw.init()
    mesh = sw.Mesh(tp=-1)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // max(1, world.world_size)))
    steps, info = _variants(args, mesh)
    result = _measure(args, mesh, steps)
    if mesh.rank == 0:
        result["planning"] = _planning_time(args, mesh)
        _report(args, world.world_size, {**info, **result})
    sw.comm.barrier(mesh, "tp")
    sw.shutdown()
    return 0


def _report(args: argparse.Namespace, n: int, r: dict[str, Any]) -> None:
    print(f"\nshardwise bench auto: {args.model}, tp={n}, {args.layers} layers h={args.embd} heads={args.heads} "
          f"vocab={args.vocab}, batch {args.batch}x{args.seq}, {args.repeats}x{args.steps} timed steps, torch "
          f"{torch.__version__}, {platform.node()}")
    print(r["printed"])
    print(f"\nsame plan as the hand-written Megatron plan: {r['same_plan']}")
    for name, ms in r["step_ms"].items():
        print(f"{name:<10}{ms:>9.2f} ms/step  collectives per step {r['collectives_per_step'][name]}  "
              f"first loss {r['first_loss'][name]:.6f}")
    lo, hi = r["ratio_range"]
    print(f"auto / megatron (paired per round): {r['auto_vs_megatron']:.3f} (rounds {lo:.3f}-{hi:.3f})")
    p = r["planning"]
    print(f"planning a {p['layers']}-layer model ({p['nodes']} traced nodes): trace {p['trace_s']:.3f} s, "
          f"sw.auto total {p['auto_s']:.3f} s")
    if args.json:
        plain = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        with open(args.json, "w") as f:
            json.dump({"tp": n, "args": plain, **r, "host": platform.node()}, f, indent=1)


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.auto",
                                      description="sw.auto benchmark (see `shardwise bench auto -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
