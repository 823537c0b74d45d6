"""``shardwise bench pp``: pipeline schedules against ``torch.distributed.pipelining``, measured bubble against
the simulator, ZB-H1 against 1F1B, and the measured timeline as a Chrome trace and a PNG.

``shardwise bench pp -n 2`` starts 2 local ranks through torchrun (``run_local``) that re-run this module with
``--worker``. Every rank builds the reference GPT (untied embedding/head: torch's pipelining does not keep a
weight tied across stages; no dropout) twice from one seed: one copy for ``sw.pipeline``, one for torch's
schedule on the same stage boundaries (``bench_torch``). Per schedule (``gpipe``, ``1f1b``, ``zb-h1``,
optionally ``interleaved`` with two chunks per rank and ``zb-h2``, ours only):

1. **loss check**: the first step of both on the same batch must give the same loss (same model, same data).
2. **memory**: one step each under ``bench_torch.SavedActivations`` (peak bytes autograd saved for backward,
   parameters excluded) and ours' ``last_peak_held`` (activation sets held at once).
3. **time**: ``--repeats`` rounds; in each, ``--steps`` timed steps of ours, then of torch (the order flips
   every round), for every schedule, so machine load hits them alike. ``step ms``: median over all timed steps,
   the maximum over ranks; ``vs torch``: the median over rounds of the paired ratio (this round's median step
   of ours / of torch), averaged over ranks.
4. **bubble**: after each round the last step's measured timeline (``pipe.timeline()``) gives the measured
   bubble and, from its own median per-stage F/B/W durations and an estimated communication time, the
   simulator's prediction (``bench_analysis``). Reported: medians over rounds and of the per-round relative
   difference.

Rank 0 prints the tables and writes ``--json``; ``--trace FILE.json`` / ``--plot FILE.png`` write the last
step's measured timeline of each schedule (the schedule name is inserted before the suffix when several run).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import torch

from .harness import add_launch_arguments, run_bench
from .steps import set_bench_threads, time_steps

__all__ = ["add_arguments", "main"]

AXIS = "pp"
BASE = ["gpipe", "1f1b", "zb-h1"]
EXTRA = ["interleaved", "zb-h2"]  # opt in with --schedules: two chunks per rank vs ScheduleInterleaved1F1B; ZB-H2
# (no torch counterpart: torch's ZB-V needs a V-shaped stage placement, so zb-h2 runs ours only)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, what="local ranks = pipeline stages")
    parser.add_argument("--preset", default="gpt-small", help="GPT preset (default gpt-small: 4 layers, width 256)")
    parser.add_argument("--layers", type=int, default=0, help="override the preset's n_layer (0: keep it)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, split into micro-batches (default 8)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("-m", "--microbatches", type=int, default=4, help="micro-batches per step (default 4)")
    parser.add_argument("--schedules", default=",".join(BASE), help="comma list of: " + ", ".join(BASE + EXTRA))
    parser.add_argument("--steps", type=int, default=2, help="timed steps per schedule per side per round (default 2)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per schedule per side first (default 2)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1; 0: cores / ranks)")
    parser.add_argument("--recv-ahead", type=int, default=None,
                        help="post each receive at least this many compute actions before its consumer "
                             "(default: sw.pipeline's, 1 on CPU)")
    parser.add_argument("--late-recv", action="store_true",
                        help="do not post receives before their message is sent (sw.pipeline recv_before_send=False)")
    parser.add_argument("--transport", default="auto", choices=["native", "shm", "auto"],
                        help="how our stages' messages travel (sw.pipeline transport; default auto: shared memory "
                             "when the ranks share a host on CPU, else native); torch's side always uses gloo")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining (ours only)")
    parser.add_argument("--hf", default=None, choices=["llama", "qwen2"],
                        help="instead of the GPT: a Hugging Face decoder built from a config (needs transformers), "
                             "captured by sw.pipeline(example_inputs=) vs torch.distributed.pipelining's export "
                             "frontend on the same split (gpipe, 1f1b); --layers (default 4), --hf-hidden")
    parser.add_argument("--hf-hidden", type=int, default=256, help="hidden size of the --hf decoder (default 256)")
    parser.add_argument("--json", default=None, help="write the results here (rank 0)")
    parser.add_argument("--trace", default=None, metavar="FILE.json", help="Chrome/Perfetto trace of the measured timeline")
    parser.add_argument("--plot", default=None, metavar="FILE.png", help="timeline PNG of the measured timings (matplotlib)")


def _config(args: argparse.Namespace) -> Any:
    from ..models.gpt import GPTConfig

    base = GPTConfig.preset(args.preset)
    layers = args.layers or base.n_layer
    return GPTConfig(**{**base.to_dict(), "n_layer": layers, "block_size": args.seq, "dropout": 0.0,
                        "tie_weights": False})


def _validate(args: argparse.Namespace) -> list[str]:
    names = [v.strip() for v in args.schedules.split(",") if v.strip()]
    unknown = [v for v in names if v not in BASE + EXTRA]
    if unknown or not names:
        raise ValueError(f"unknown or no schedules {unknown or names}; choose from {BASE + EXTRA}")
    if args.recv_ahead is not None and args.recv_ahead < 0:
        raise ValueError(f"--recv-ahead must be >= 0 (compute actions a receive is posted early), got {args.recv_ahead}")
    for flag in ("batch", "seq", "microbatches", "steps", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    if args.nproc < 2:
        raise ValueError(f"a pipeline benchmark needs -n >= 2 ranks (one stage each), got {args.nproc}")
    if args.batch % args.microbatches:
        raise ValueError(f"--batch {args.batch} must be divisible by --microbatches {args.microbatches}; use e.g. "
                         f"--batch {args.microbatches * max(1, args.batch // args.microbatches)}")
    cfg = _config(args)  # validates the preset and --layers
    for name in names:
        chunks = 2 if name == "interleaved" else 1
        if cfg.n_layer + 2 < args.nproc * chunks:
            raise ValueError(f"{name} on {args.nproc} ranks needs {args.nproc * chunks} stages but the model has "
                             f"{cfg.n_layer + 2} units (embedding, {cfg.n_layer} blocks, head); use --layers "
                             f"{args.nproc * chunks - 2} or more")
        if name == "interleaved" and args.microbatches % args.nproc:
            raise ValueError(f"interleaved needs --microbatches a multiple of -n {args.nproc}, got "
                             f"{args.microbatches}")
    for flag, suffix in (("trace", ".json"), ("plot", ".png")):
        if getattr(args, flag) and not getattr(args, flag).endswith(suffix):
            raise ValueError(f"--{flag} {getattr(args, flag)!r} must end in {suffix}")
    return names


def main(args: argparse.Namespace) -> int:
    """Validate, then launch ``-n`` local ranks (or, with ``--worker``, be one rank of a torchrun job)."""
    return run_bench("pp", args, validate=_validate, worker=_dispatch)


def output_path(path: str, name: str, names: list[str]) -> str:
    """``path`` itself for one schedule, else the schedule name inserted before the suffix (t.json -> t.1f1b.json)."""
    if len(names) == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{name}{p.suffix}"))


# -- inside a rank ----------------------------------------------------------------------------------
def _dispatch(args: argparse.Namespace) -> int:
    """One rank: the GPT comparison, or with ``--hf`` a transformers decoder's (``pp_hf.py``)."""
    if args.hf:
        from .pp_hf import run_hf
        return run_hf(args)
    return _run_worker(args)


def _run_worker(args: argparse.Namespace) -> int:
    import shardwise as sw

    from ..models.gpt import GPT, lm_loss, synthetic_batch
    from .pp_report import gather_and_report
    from .pp_torch import TORCH_SCHEDULES, SavedActivations, our_runner, torch_runner

    load_start = os.getloadavg()
    world = sw.init()
    mesh = sw.Mesh(pp=-1)
    set_bench_threads(args.threads, world.world_size)
    names = _validate(args)
    cfg = _config(args)
    gen = torch.Generator().manual_seed(1234)  # every rank passes the same batches
    batches = [tuple(t.to(mesh.device) for t in synthetic_batch(args.batch, args.seq, cfg.vocab_size, gen))
               for _ in range(2)]

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT(cfg).to(mesh.device)
    params = sum(q.numel() for q in build().parameters())  # before sw.pipeline releases other stages' tensors
    pipes, ours, theirs, local = {}, {}, {}, {}
    for name in names:
        pipes[name] = sw.pipeline(build(), mesh, AXIS, microbatches=args.microbatches, schedule=name,
                                  loss_fn=lm_loss, chunks=2 if name == "interleaved" else 1,
                                  recv_ahead=args.recv_ahead, recv_before_send=False if args.late_recv else None,
                                  transport=args.transport)
        ours[name] = our_runner(pipes[name])
        if not args.no_torch and name in TORCH_SCHEDULES:
            theirs[name], local[name] = torch_runner(name, build(), pipes[name], mesh, AXIS, lm_loss)
    res: dict[str, dict[str, Any]] = {name: {"loss": [], "held": 0, "saved": [], "times": {"ours": [], "torch": []},
                                             "timelines": []} for name in names}
    for name in names:  # loss check, memory, warm-up
        sides = [("ours", ours[name], list(pipes[name].parameters()))]
        if name in theirs:
            sides.append(("torch", theirs[name], [q for mod in local[name] for q in mod.parameters()]))
        for side, step, weights in sides:
            res[name]["loss"].append(step(*batches[0]))
            with SavedActivations(weights) as meter:
                step(*batches[1])
            res[name]["saved"].append(meter.peak)
            time_steps(step, batches, args.warmup)
        res[name]["held"] = pipes[name].last_peak_held
    for r in range(args.repeats):
        for name in names:
            order = [("ours", ours[name]), ("torch", theirs.get(name))]
            for side, step in (order if r % 2 == 0 else order[::-1]):
                if step is None:
                    continue
                sw.comm.barrier(mesh, AXIS)
                res[name]["times"][side].append(time_steps(step, batches, args.steps))
                if side == "ours":
                    res[name]["timelines"].append(pipes[name].timeline())  # collective: the last timed step
    _write_timelines(args, names, pipes, mesh)
    gather_and_report(args, names, pipes, res, mesh, (world.world_size, params), load_start)
    sw.shutdown()
    return 0


def _write_timelines(args: argparse.Namespace, names: list[str], pipes: dict, mesh: Any) -> None:
    """Trace and PNG of each schedule's last step (collective: ``write_trace`` / ``timeline`` all-gather)."""
    from .timeline_plot import plot_timeline

    for name in names:
        pipe = pipes[name]
        if args.trace:
            events = pipe.write_trace(output_path(args.trace, name, names))
        elif args.plot:
            events = pipe.timeline()
        if args.plot and mesh.coord(AXIS) == 0:
            s = pipe.schedule
            plot_timeline(events, p=s.p, path=output_path(args.plot, name, names), chunks=s.chunks,
                          split_backward=s.split_backward,
                          title=f"{name}: measured timeline, p={s.p} m={s.m} (seconds)")


if __name__ == "__main__":
    from shardwise.world import exit_process

    _parser = argparse.ArgumentParser(prog="python -m shardwise.bench.pp",
                                      description="pipeline schedules vs torch (see `shardwise bench pp -h`)")
    add_arguments(_parser)
    exit_process(main(_parser.parse_args()))
