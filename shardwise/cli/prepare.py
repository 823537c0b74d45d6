"""``shardwise prepare INPUT... --tokenizer PATH --out DIR``: tokenize a corpus once into memory-mappable shards.

Inputs: text files (cut into documents by ``--documents``: a lone text file at blank lines or line ends, else
each file whole), directories of them, JSON Lines (``--field``), a ``datasets`` directory
(``save_to_disk``); ``--sft`` reads prompt/response records, or chat records (``--messages-field``, rendered with
the tokenizer's chat template), and writes loss masks. The work is
``shardwise.data.prepare.prepare``; the format and the reader are in docs/data.md. Every refusal is one line
on stderr (``shardwise prepare: error: ...``), exit code 2, and leaves nothing behind.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

from ..data.prepare import PrepareOptions, PrepareReport, default_workers, prepare

__all__ = ["add_arguments", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text files, directories of them (recursive, sorted), .jsonl/.json files, or a datasets "
                             "directory written by save_to_disk")
    parser.add_argument("--tokenizer", required=True, metavar="PATH",
                        help="a Hugging Face tokenizer.json, or a model directory holding one")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory (must not exist, or --force; missing parents are created)")
    parser.add_argument("--val-fraction", type=float, default=0.0, metavar="F",
                        help="fraction of documents for the validation split, in [0, 1) (default 0: none)")
    parser.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                        help=f"encoding processes (default min(4, CPUs) = {default_workers()}); the output is the "
                             f"same for any N")
    parser.add_argument("--field", default="text", metavar="NAME",
                        help="JSON Lines / dataset field holding the document text (default text)")
    parser.add_argument("--sft", action="store_true",
                        help="supervised fine-tuning records: prompt and response fields; writes loss masks")
    parser.add_argument("--prompt-field", default="prompt", metavar="NAME", help="--sft: prompt field (default prompt)")
    parser.add_argument("--response-field", default="response", metavar="NAME",
                        help="--sft: response field (default response)")
    parser.add_argument("--messages-field", default="messages", metavar="NAME",
                        help="--sft: a record with this field (a list of {role, content}; roles system, user, "
                             "assistant) is a chat record, rendered with the tokenizer's chat_template; the loss "
                             "is on the assistant turns (default messages)")
    parser.add_argument("--force", action="store_true", help="replace an existing prepared dataset at --out")
    parser.add_argument("--shard-tokens", type=int, default=2 ** 28, metavar="N",
                        help="tokens per shard file at most (default 2**28)")
    parser.add_argument("--glob", action="append", metavar="PATTERN",
                        help="read only a directory's files whose name or relative path matches (repeatable), e.g. "
                             "--glob '*.py'; files named explicitly are always read")
    parser.add_argument("--documents", default="auto", metavar="MODE",
                        help="how text files are cut into documents (each gets an EOS; --val-fraction draws them): "
                             "auto (default: a lone text file INPUT at blank lines if it has any, else at line "
                             "ends; with several files or a directory, each file whole), file, blank-lines, lines, "
                             "separator:STR")
    parser.add_argument("--eos-token", default=None, metavar="TOKEN",
                        help="the token appended after each document (default: the tokenizer's end-of-text token)")


def _options(args: argparse.Namespace) -> PrepareOptions:
    return PrepareOptions(inputs=tuple(args.inputs), tokenizer=args.tokenizer, out=args.out,
                          val_fraction=args.val_fraction, workers=args.workers, field=args.field, sft=args.sft,
                          prompt_field=args.prompt_field, response_field=args.response_field,
                          messages_field=args.messages_field, force=args.force,
                          shard_tokens=args.shard_tokens, eos_token=args.eos_token, glob=tuple(args.glob or ()),
                          documents=args.documents)


def _progress_bar() -> tuple[Any, Callable[[Any], None]] | tuple[None, None]:
    """A rich progress line on stderr when it is a terminal: documents, tokens and MB, with their rates."""
    if not sys.stderr.isatty():
        return None, None
    import time

    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=True)
    task = bar.add_task("encoding")
    totals = {"docs": 0, "tokens": 0, "bytes": 0}
    t0 = time.perf_counter()

    def update(res: Any) -> None:
        totals["docs"] += res.train.documents + res.val.documents
        totals["tokens"] += len(res.train.tokens) + len(res.val.tokens)
        totals["bytes"] += res.nbytes
        dt = max(time.perf_counter() - t0, 1e-9)
        bar.update(task, description=(
            f"{totals['docs']:,} documents ({totals['docs'] / dt:,.0f}/s)  {totals['tokens']:,} tokens "
            f"({totals['tokens'] / dt:,.0f}/s)  {totals['bytes'] / 1e6:,.1f} MB ({totals['bytes'] / 1e6 / dt:.1f} MB/s)"))
    return bar, update


def _summary(r: PrepareReport) -> str:
    splits = [f"train {r.tokens['train']:,} tokens in {r.documents['train']:,} documents"]
    if r.documents["val"]:
        splits.append(f"val {r.tokens['val']:,} tokens in {r.documents['val']:,} documents")
    total = sum(r.tokens.values())
    return (f"shardwise prepare: wrote {r.out}: " + "; ".join(splits) + f" ({total / max(r.seconds, 1e-9):,.0f} "
            f"tokens/s, {r.nbytes / 1e6 / max(r.seconds, 1e-9):.1f} MB/s, {r.seconds:.1f} s)")


def main(args: argparse.Namespace) -> int:
    bar, update = _progress_bar()
    try:
        if bar is not None:
            with bar:
                report = prepare(_options(args), progress=update)
        else:
            report = prepare(_options(args))
    except ValueError as exc:
        print(f"shardwise prepare: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # prepare removed its temporary directory and stopped its workers
        print(f"shardwise prepare: interrupted; {args.out} was not written (an existing one is untouched)",
              file=sys.stderr)
        return 130
    print(_summary(report))
    return 0
