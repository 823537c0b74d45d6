"""``shardwise bench compile``: what ``--train.compile`` (regional ``torch.compile``) does to the step time of each
layout — compiled over eager, medians of paired interleaved runs — and what compiling costs.

    shardwise bench compile -n 2 --preset gpt-small --layouts 1,dp2,zero3,tp2sp,pp2 --repeats 5

Every rank builds each layout twice through the trainer's own code (``runtime/strategy``: the same wrappers,
passes and optimizer as ``shardwise train``) from the same seed: eagerly and with ``train.compile``. A layout of
``k`` processes runs on ``-n / k`` replicas side by side (an outer ``rep`` mesh axis), so every layout keeps all
``-n`` ranks busy. Layouts: ``1`` (one process), ``dp2`` (``DataParallel``), ``zero3`` (ZeRO-3 over dp=2),
``tp2sp`` (tensor parallelism with sequence parallelism), ``pp2`` (a 2-stage 1F1B pipeline), also ``zero1``,
``tp2``, ``zb`` (2-stage ZB-H1), ``ac`` (one process, activation checkpointing).

Warm-up: ``--warmup`` steps of each variant (the compiled one's first step compiles; ``compile s`` is dynamo's
compile time on rank 0 and ``first step s`` that step's time). Then ``--repeats`` rounds, each timing ``--steps``
steps of eager, then of compiled: ``ratio`` is the median over rounds of (compiled median step / eager median step
of the same round), so a machine that slows down mid-run slows both sides of a pair. Both variants see the same
batches in the same order, so their losses must agree: ``max rel Δloss`` over every step. Rank 0's clock (the
steps are collective). Rank 0 prints the table and writes ``--json``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from .harness import add_launch_arguments, paired_ratio, run_bench, write_json

__all__ = ["add_arguments", "main", "LAYOUTS"]

LAYOUTS: dict[str, dict[str, Any]] = {
    "1": {}, "ac": {"parallel.activation_checkpointing": True},
    "dp2": {"parallel.dp": 2}, "zero1": {"parallel.dp": 2, "parallel.zero_stage": 1},
    "zero3": {"parallel.dp": 2, "parallel.zero_stage": 3},
    "tp2": {"parallel.tp": 2}, "tp2sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "pp2": {"parallel.pp": 2, "parallel.pp_schedule": "1f1b"},
    "zb": {"parallel.pp": 2, "parallel.pp_schedule": "zb-h1"},
}
"""Layout name -> the ``shardwise train`` overrides that make it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, nproc=2, what="local ranks (a multiple of every layout's process count)")
    parser.add_argument("--preset", default="gpt-small", help="model preset (default gpt-small)")
    parser.add_argument("--layouts", default="1,dp2,zero3,tp2sp,pp2",
                        help=f"comma list of layouts among {list(LAYOUTS)} (default 1,dp2,zero3,tp2sp,pp2)")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per rank per step (default 4)")
    parser.add_argument("--block-size", type=int, default=0, help="sequence length (default: the preset's)")
    parser.add_argument("--layers", type=int, default=0, help="transformer blocks (default: the preset's)")
    parser.add_argument("--embd", type=int, default=0, help="hidden width (default: the preset's)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round (default 3)")
    parser.add_argument("--repeats", type=int, default=5, help="paired rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first (default 2)")
    parser.add_argument("--backend", default="inductor", help="train.compile_backend (default inductor)")
    parser.add_argument("--json", default=None, help="write the results as JSON to this file")


def _validate(args: argparse.Namespace) -> list[str]:
    names = [s for s in args.layouts.split(",") if s]
    unknown = [s for s in names if s not in LAYOUTS]
    if unknown or not names:
        raise ValueError(f"--layouts {args.layouts!r}: unknown {unknown}; choose from {list(LAYOUTS)}")
    for name in names:
        if args.nproc % _size(name):
            raise ValueError(f"layout {name} runs on {_size(name)} processes, which must divide -n {args.nproc}; "
                             f"e.g. -n 2")
    for flag in ("micro_batch", "steps", "repeats", "warmup"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} = {getattr(args, flag)} must be >= 1")
    return names


def _size(name: str) -> int:
    o = LAYOUTS[name]
    return o.get("parallel.dp", 1) * o.get("parallel.tp", 1) * o.get("parallel.pp", 1)


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("compile", args, validate=_validate, worker=_run_worker)


# -- inside a rank ----------------------------------------------------------------------------------
def _config(args: argparse.Namespace, name: str, compiled: bool) -> Any:
    from ..runtime.config import load_config, validate

    o = LAYOUTS[name]
    model = {f"model.{k}": v for k, v in (("block_size", args.block_size), ("n_layer", args.layers),
                                            ("n_embd", args.embd)) if v}
    dp = o.get("parallel.dp", 1)
    overrides = {**o, **model, "parallel.nproc": _size(name), "parallel.dp": dp, "parallel.grad_accum": 1,
                 "parallel.micro_batch": args.micro_batch, "data.global_batch": args.micro_batch * dp,
                 "train.compile": compiled, "train.compile_backend": args.backend, "train.memory_check": False,
                 "optimizer.name": "sgd", "optimizer.warmup_steps": 0}
    if o.get("parallel.pp", 1) > 1:
        overrides["parallel.pp_microbatches"] = min(2, args.micro_batch)
    return validate(load_config(preset=args.preset, overrides=overrides))


class _Variant:
    """One layout, eager or compiled: its strategy on the rank's mesh and its step."""

    def __init__(self, args: argparse.Namespace, name: str, compiled: bool, n: int) -> None:
        from ..mesh import Mesh
        from ..runtime.strategy import build_strategy, mesh_axes

        self.cfg = _config(args, name, compiled)
        axes = mesh_axes(self.cfg.parallel)
        self.mesh = Mesh(rep=n // _size(name), **axes)
        torch.manual_seed(self.cfg.train.seed)
        self.strategy = build_strategy(self.cfg, self.mesh)
        self.rows = args.micro_batch * (self.cfg.parallel.dp if self.cfg.parallel.pp > 1 else 1)
        self.losses: list[float] = []

    def step(self, batch: torch.Tensor) -> float:
        """One training step on ``batch`` (rows, T + 1) of token ids; its time. Collective over the layout."""
        s = self.strategy
        x, y = batch[: self.rows, :-1], batch[: self.rows, 1:]
        if self.cfg.parallel.pp == 1 and self.cfg.parallel.dp > 1:  # this dp rank's rows of the global batch
            d, per = self.mesh.coord("dp"), batch.size(0) // self.cfg.parallel.dp
            x, y = batch[d * per:(d + 1) * per, :-1], batch[d * per:(d + 1) * per, 1:]
        start = time.perf_counter()
        loss = s.passes([(x, y)], {"fwd": 0.0, "bwd": 0.0, "comm": 0.0}, lambda: None, poison=False)
        s.optimizer.step()
        s.optimizer.zero_grad(set_to_none=True)
        self.losses.append(s.mean_loss(loss))
        return time.perf_counter() - start


def _layout(args: argparse.Namespace, name: str, n: int) -> dict[str, Any]:
    from ..parallel.common.compile import compile_stats

    eager, comp = _Variant(args, name, False, n), _Variant(args, name, True, n)
    cfg = eager.cfg.model
    g = torch.Generator().manual_seed(1)
    rows = args.micro_batch * eager.cfg.parallel.dp
    total = args.warmup + args.repeats * args.steps
    batches = [torch.randint(0, cfg.vocab_size, (rows, cfg.block_size + 1), generator=g) for _ in range(total)]
    for b in batches[:args.warmup]:
        eager.step(b)
    first = [comp.step(b) for b in batches[:args.warmup]][0]
    rounds_e, rounds_c = [], []
    for r in range(args.repeats):
        chunk = batches[args.warmup + r * args.steps: args.warmup + (r + 1) * args.steps]
        rounds_e.append([eager.step(b) for b in chunk])
        rounds_c.append([comp.step(b) for b in chunk])
    stats = compile_stats(comp.strategy.plain)
    delta = max(abs(a - b) / abs(a) for a, b in zip(eager.losses, comp.losses))
    return {"layout": name, "processes": _size(name), "eager_step_s": statistics.median(sum(rounds_e, [])),
            "compiled_step_s": statistics.median(sum(rounds_c, [])), "ratio": paired_ratio(rounds_c, rounds_e),
            "compile_s": stats.compile_s, "first_step_s": first, "graphs": stats.graphs,
            "graph_breaks": stats.graph_breaks, "recompiles": stats.recompiles, "max_rel_dloss": delta,
            "rounds_eager": rounds_e, "rounds_compiled": rounds_c}


def _run_worker(args: argparse.Namespace) -> int:
    import warnings

    import shardwise as sw

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed's deprecation notes, per call
    world = sw.init()
    rows = [_layout(args, name, world.world_size) for name in _validate(args)]
    if world.rank == 0:
        _print(args, rows)
        if args.json:
            kept = {k: v for k, v in vars(args).items() if k not in ("worker", "_bench_parser")}
            write_json(args.json, {"args": kept, "rows": rows, "torch": torch.__version__,
                                   "threads": torch.get_num_threads()})
    sw.shutdown()
    return 0


def _print(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(f"shardwise bench compile: {args.preset}, micro-batch {args.micro_batch}, backend {args.backend}, "
          f"{args.repeats} rounds × {args.steps} steps (median of paired rounds), -n {args.nproc}")
    print(f"{'layout':<8} {'procs':>5} {'eager ms':>9} {'compiled ms':>11} {'ratio':>6} {'compile s':>9} "
          f"{'first step s':>12} {'graphs':>6} {'breaks':>6} {'recomp':>6} {'max rel dloss':>13}")
    for r in rows:
        print(f"{r['layout']:<8} {r['processes']:>5} {r['eager_step_s'] * 1e3:>9.1f} "
              f"{r['compiled_step_s'] * 1e3:>11.1f} "
              f"{r['ratio']:>6.2f} {r['compile_s']:>9.1f} {r['first_step_s']:>12.1f} {r['graphs']:>6} "
              f"{r['graph_breaks']:>6} {r['recompiles']:>6} {r['max_rel_dloss']:>13.1e}")


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.compile",
                                      description="compiled/eager step ratio per layout "
                                                  "(see `shardwise bench compile -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
