"""The ``shardwise`` command line: ``run``, ``train``, ``verify``, ``export``, ``plot``, ``generate``, ``prepare``,
``schedule``, ``predict``, ``plan``, ``calibrate`` (``COMMANDS``) and ``bench KIND`` for ``KIND`` in comm, dp, sbp,
tp, pp, zero, cp, compile, planner, auto, prepare, moe, memory (``BENCHES``).

Each command lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int`` (``Command``):
``shardwise/cli/NAME.py`` for a command, ``shardwise/bench/KIND.py`` for a benchmark. This file only wires them
up through one small loader function per command, which imports the module when its command is used (so
``shardwise --help`` stays fast). The measurement campaigns behind ``benchmarks/RESULTS.md`` (published tables,
the layout search against measurement, the fault campaign) are scripts in ``benchmarks/``, outside the package.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from functools import partial
from typing import Any, Callable, NoReturn, Protocol, Sequence

__all__ = ["main"]

class Command(Protocol):
    """What a subcommand module provides (``cli/train.py``, ``bench/pp.py``, ...)."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def main(self, args: argparse.Namespace) -> int | None: ...


# Commands are imported only when used: the imports pull in torch, and only the command actually run may pay
# for that (``shardwise --help`` stays fast). Explicit import statements, not module-name strings, so readers,
# IDEs and import checkers see the wiring.

def _command(name: str) -> Command:
    if name == "run":
        from . import run as module
    elif name == "schedule":
        from . import schedule as module
    elif name == "train":
        from . import train as module
    elif name == "verify":
        from . import verify as module
    elif name == "export":
        from . import export as module
    elif name == "plot":
        from . import plot as module
    elif name == "predict":
        from . import predict as module
    elif name == "calibrate":
        from . import calibrate as module
    elif name == "plan":
        from . import plan as module
    elif name == "generate":
        from . import generate as module
    elif name == "prepare":
        from . import prepare as module
    else:
        raise KeyError(name)
    return module


def _bench(name: str) -> Command:
    if name == "comm":
        from ..bench import comm as module
    elif name == "dp":
        from ..bench import dp as module
    elif name == "sbp":
        from ..bench import sbp as module
    elif name == "tp":
        from ..bench import tp as module
    elif name == "pp":
        from ..bench import pp as module
    elif name == "zero":
        from ..bench import zero as module
    elif name == "cp":
        from ..bench import cp as module
    elif name == "compile":
        from ..bench import compile as module
    elif name == "planner":
        from ..bench import planner as module
    elif name == "auto":
        from ..bench import auto as module
    elif name == "prepare":
        from ..bench import prepare as module
    elif name == "moe":
        from ..bench import moe as module
    elif name == "memory":
        from ..bench import memory as module
    else:
        raise KeyError(name)
    return module


# command -> (loader, one-line help)
COMMANDS: dict[str, tuple[Callable[[], Command], str]] = {
    "run": (partial(_command, "run"), "launch a script on N local ranks (torchrun underneath)"),
    "schedule": (partial(_command, "schedule"), "print, simulate and plot a pipeline schedule"),
    "train": (partial(_command, "train"), "train the reference GPT on local ranks (config, checkpoints, resume)"),
    "verify": (partial(_command, "verify"), "check a layout trains to the same losses as one process"),
    "export": (partial(_command, "export"), "consolidate a sharded checkpoint into one safetensors file"),
    "plot": (partial(_command, "plot"), "draw loss and throughput PNGs of a run"),
    "predict": (partial(_command, "predict"), "step time, throughput and memory of a config on given hardware, "
                "before it runs (the planner)"),
    "plan": (partial(_command, "plan"), "search every layout of a model on N devices: the fastest that fit, "
             "ranked, before anything runs"),
    "prepare": (partial(_command, "prepare"), "tokenize text / JSON Lines / a datasets dataset once into "
                "memory-mapped shards with a checksummed index (train and val splits, SFT loss masks)"),
    "calibrate": (partial(_command, "calibrate"), "measure this machine (GEMM, bandwidth, collectives) into a "
                  "hardware JSON for the planner and algorithm=auto"),
    "generate": (partial(_command, "generate"), "continue a prompt with a run's, a checkpoint's or a Hugging Face "
                 "directory's model (one device, KV cache)"),
}
# bench kind -> (loader, one-line help)
BENCHES: dict[str, tuple[Callable[[], Command], str]] = {
    "comm": (partial(_bench, "comm"), "collective bus bandwidth: native vs ring vs tree, alpha-beta fit"),
    "dp": (partial(_bench, "dp"), "DataParallel step time vs torch DDP, overlap, buckets"),
    "sbp": (partial(_bench, "sbp"), "global-tensor op and boxing overhead vs DTensor; boxing bytes"),
    "tp": (partial(_bench, "tp"), "tensor-parallel step time vs torch parallelize_module; boxing"),
    "pp": (partial(_bench, "pp"), "pipeline schedules vs torch.distributed.pipelining; bubble vs simulator"),
    "zero": (partial(_bench, "zero"), "sw.zero stages 1-3 step time and memory vs torch FSDP2 and ZeRO-1"),
    "cp": (partial(_bench, "cp"), "context parallelism (ring attention) at a long sequence: activation memory "
           "per rank, step time and hidden ring communication vs one rank and the planner"),
    "compile": (partial(_bench, "compile"), "regional torch.compile (--train.compile): compiled/eager step ratio "
                "per layout, compile time, recompiles"),
    "planner": (partial(_bench, "planner"), "planner predictions vs layouts measured on this machine (several "
                "ranks or one accelerator)"),
    "auto": (partial(_bench, "auto"), "sw.auto's plan vs the hand-written Megatron plan: step time, collectives, "
             "planning time"),
    "prepare": (partial(_bench, "prepare"), "shardwise prepare's tokens/s and peak memory vs the tokenizers "
                "package's encode_batch on as many cores"),
    "memory": (partial(_bench, "memory"), "each layout's whole-run peak against its memory floor (the ledger): "
               "ratio, phase of the peak, biggest named excess"),
    "moe": (partial(_bench, "moe"), "mixtures of experts: grouped experts vs a per-expert loop; expert "
            "parallelism's step time vs transformers' on the same model and ranks"),
}

# The packages the loaders import from. An ImportError naming one of them means the command's module is not in
# this build (a wheel without ``shardwise.bench``); any other missing name is a real error and is raised.
_COMMAND_PACKAGES = frozenset({__package__ or "shardwise.cli", (__package__ or "shardwise.cli").rpartition(".")[0]
                               + ".bench"})


class _Parser(argparse.ArgumentParser):
    """Every usage error is one line ``PROG: error: MESSAGE; see PROG --help`` (no usage dump), with a close
    match suggested for an unknown option (``flag_hints.suggest``) or choice; exit code 2. Options are never
    abbreviated (``allow_abbrev=False``). Subparsers inherit the class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # --parallel.zero must not quietly mean --parallel.zero_stage
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if choice:
            given = choice[1]  # the choices are quoted up to Python 3.12, bare after
            options = re.findall(r"'([^']*)'", choice[2]) or [o.strip() for o in choice[2].split(",")]
            hint = _close(given, options)
            message = (message[:choice.start()] + f"invalid choice {given!r}; "
                       + (f"did you mean {hint}? " if hint else "") + "choose from " + ", ".join(options))
        elif not message.endswith("?"):
            message += f"; see '{self.prog} --help'"
        self.exit(2, f"{self.prog}: error: {message}\n")

    def unknown_arguments(self, extra: Sequence[str]) -> NoReturn:
        """Report the first argument this parser does not know, with a close option name if there is one."""
        first = extra[0]
        if first.startswith("-") and len(first) > 1:
            from .flag_hints import suggest

            name = first.partition("=")[0]
            hint = suggest(name, self._option_string_actions)
            abbreviated = " (options are not abbreviated)" if hint.startswith(name) else ""
            self.error(f"unknown option {name}{abbreviated}" + (f"; did you mean {hint}?" if hint else ""))
        self.error(f"unexpected argument {first!r}")


def _close(given: str, options: Sequence[str]) -> str:
    """The option closest to ``given`` (difflib), or ''."""
    close = difflib.get_close_matches(given, list(options), n=1, cutoff=0.75)
    return close[0] if close else ""


def _add_module(sub: argparse._SubParsersAction, name: str, load: Callable[[], Command], help_: str) -> None:
    parser = sub.add_parser(name, help=help_, description=help_)
    try:
        mod = load()
    except ImportError as exc:
        if exc.name not in _COMMAND_PACKAGES:
            raise
        parser.set_defaults(_missing=name)
        return
    mod.add_arguments(parser)
    parser.set_defaults(_main=mod.main)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _Parser(prog="shardwise", description="Train one model on many devices as if "
                                     "they were one.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only import the module of the command actually used (imports pull in torch).
    wanted = [a for a in argv if not a.startswith("-")][:2]
    for name, (load, help_) in COMMANDS.items():
        if wanted[:1] == [name]:
            _add_module(sub, name, load, help_)
        else:
            sub.add_parser(name, help=help_)
    bench = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    bench_sub = bench.add_subparsers(dest="bench", metavar="KIND")
    for name, (load, help_) in BENCHES.items():
        if wanted == ["bench", name]:
            _add_module(bench_sub, name, load, help_)
        else:
            bench_sub.add_parser(name, help=help_)
    return parser


def _used_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> _Parser:
    """The (sub)parser of the command the arguments selected, e.g. that of ``shardwise bench comm``."""
    for dest in ("command", "bench"):
        name = getattr(args, dest, None)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not name or not subs or name not in subs[0].choices:
            break
        parser = subs[0].choices[name]
    return parser  # type: ignore[return-value]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args, extra = parser.parse_known_args(argv)
    if extra:
        _used_parser(parser, args).unknown_arguments(extra)
    if getattr(args, "_missing", None):
        print(f"shardwise: '{args._missing}' is not available in this build", file=sys.stderr)
        return 2
    fn = getattr(args, "_main", None)
    if fn is None and getattr(args, "command", None) == "bench":
        _used_parser(parser, args).error(f"which benchmark? give a KIND: {', '.join(BENCHES)}")
    if fn is None:
        parser.print_help()
        return 2
    return int(fn(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
