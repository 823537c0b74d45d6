"""``shardwise run -n 4 script.py ARGS``: start local ranks through torch's elastic launcher (torchrun)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..runtime.launch import run_local

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--nproc", type=int, default=2, help="ranks on this node (default 2)")
    parser.add_argument("--nnodes", default=None, help="nodes in the job, e.g. 2 (passed to torchrun)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's index (passed to torchrun)")
    parser.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous (multi-node)")
    parser.add_argument("-m", "--module", action="store_true", help="run TARGET as a module (python -m)")
    parser.add_argument("target", help="script (or module with -m) to run on every rank")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")


def main(args: argparse.Namespace) -> int:
    try:
        if args.nproc < 1:
            raise ValueError(f"-n/--nproc = {args.nproc} must be >= 1; e.g. shardwise run -n 2 {args.target}")
        if not args.module and not Path(args.target).is_file():
            raise ValueError(f"script {args.target!r} does not exist; pass the path of a Python file, or -m MODULE "
                             f"to run a module")
        return run_local(args.nproc, [args.target, *args.args], module=args.module, nnodes=args.nnodes,
                         node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    except ValueError as exc:
        print(f"shardwise run: error: {exc}", file=sys.stderr)
        return 2
