"""``shardwise`` command line: ``run``, ``bench KIND``, ``schedule`` (more as they land).

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``; this
file only wires them up, importing a module when its command is used (so ``shardwise --help`` stays fast).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

__all__ = ["main"]

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("shardwise.runtime.run_cmd", "launch a script on N local ranks (torchrun underneath)"),
    "schedule": ("shardwise.parallel.pipeline.schedule_cmd", "print, simulate and plot a pipeline schedule"),
    "train": ("shardwise.runtime.train_cmd", "train the reference GPT on local ranks (config, checkpoints, resume)"),
    "verify": ("shardwise.runtime.verify_cmd", "check a layout trains to the same losses as one process"),
    "export": ("shardwise.runtime.export_cmd", "consolidate a sharded checkpoint into one safetensors file"),
    "plot": ("shardwise.runtime.plot_cmd", "draw loss and throughput PNGs of a run"),
}
# bench kind -> (module, one-line help)
BENCHES: dict[str, tuple[str, str]] = {
    "comm": ("shardwise.comm.bench", "collective bus bandwidth: native vs ring vs tree, alpha-beta fit"),
    "dp": ("shardwise.parallel.data_bench", "DataParallel step time vs torch DDP, overlap, buckets"),
    "sbp": ("shardwise.sbp.bench", "global-tensor op and boxing overhead vs DTensor; boxing bytes"),
    "tp": ("shardwise.parallel.tensor_bench", "tensor-parallel step time vs torch parallelize_module; boxing"),
    "pp": ("shardwise.parallel.pipeline.bench", "pipeline schedules vs torch.distributed.pipelining; bubble vs simulator"),
    "zero": ("shardwise.parallel.zero_bench", "sw.zero stages 1-3 step time and memory vs torch FSDP2 and ZeRO-1"),
}


def _add_module(sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    parser = sub.add_parser(name, help=help_, description=help_)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is None or not module.startswith(exc.name):
            raise
        parser.set_defaults(_missing=name)
        return
    mod.add_arguments(parser)
    parser.set_defaults(_main=mod.main)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardwise", description="Train one model on many devices as if "
                                     "they were one.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only import the module of the command actually used (imports pull in torch).
    wanted = [a for a in argv if not a.startswith("-")][:2]
    for name, (module, help_) in COMMANDS.items():
        if wanted[:1] == [name]:
            _add_module(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    bench_sub = bench.add_subparsers(dest="bench", metavar="KIND")
    for name, (module, help_) in BENCHES.items():
        if wanted == ["bench", name]:
            _add_module(bench_sub, name, module, help_)
        else:
            bench_sub.add_parser(name, help=help_)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", None):
        print(f"shardwise: '{args._missing}' is not available in this build", file=sys.stderr)
        return 2
    fn = getattr(args, "_main", None)
    if fn is None:
        parser.print_help()
        return 2
    return int(fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
