"""The command-line reference as Markdown, generated from the argparse parsers of ``cli/main.py``.

``python -m shardwise.cli.reference`` prints it; the documentation site builds its ``reference/cli.md`` page
from ``markdown()`` at build time (``docs/hooks.py``), so the page cannot go stale.
"""

from __future__ import annotations

import argparse
import os
from contextlib import contextmanager
from typing import Iterator

from .main import BENCHES, COMMANDS, build_parser

__all__ = ["markdown", "commands"]

_WIDTH = 100  # help text is wrapped to this many columns, whatever the terminal


@contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps help to ``$COLUMNS``: fix it while formatting, so the page is the same everywhere."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def commands() -> list[tuple[str, argparse.ArgumentParser]]:
    """``(command line, parser)`` for ``shardwise`` and every command and benchmark, in ``--help`` order.

    Each command's parser is built as ``main`` builds it when that command is run (its module imported, its
    arguments added)."""
    with _columns(_WIDTH):
        out = [("shardwise", build_parser([]))]
        for name in COMMANDS:
            out.append((f"shardwise {name}", _subparser(build_parser([name]), name)))
        out.append(("shardwise bench", _subparser(build_parser(["bench"]), "bench")))
        for name in BENCHES:
            bench = _subparser(build_parser(["bench", name]), "bench")
            out.append((f"shardwise bench {name}", _subparser(bench, name)))
    return out


def markdown() -> str:
    """The whole page: a table of the commands, then each command's ``--help`` under its own heading."""
    parsers = commands()
    lines = [
        "# Command line",
        "",
        "Every command's `--help`, generated from its parser when the site is built "
        "(`python -m shardwise.cli.reference` prints this page).",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    helps = {f"shardwise {n}": h for n, (_, h) in COMMANDS.items()}
    helps.update({f"shardwise bench {n}": h for n, (_, h) in BENCHES.items()})
    helps["shardwise bench"] = "benchmarks: " + ", ".join(BENCHES)
    for prog, _ in parsers[1:]:
        anchor = prog.replace(" ", "-")
        lines.append(f"| [`{prog}`](#{anchor}) | {helps[prog]} |")
    with _columns(_WIDTH):
        for prog, parser in parsers:
            lines += ["", f"## {prog} {{#{prog.replace(' ', '-')}}}", "", "```text", parser.format_help().rstrip(),
                      "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
