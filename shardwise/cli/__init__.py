"""The ``shardwise`` command line: one module per command (``run``, ``train``, ``verify``, ``export``, ``plot``,
``generate``, ``prepare``, ``schedule``, ``predict``, ``plan``, ``calibrate``; ``bench KIND`` in ``shardwise.bench``),
wired in ``main.py``."""

from typing import NoReturn

from .main import build_parser, main

__all__ = ["main", "build_parser", "entry"]


def entry() -> NoReturn:
    """The ``shardwise`` console script: ``main()``, then ``world.exit_process`` with its code (``main`` itself
    returns, so that it can be called in-process)."""
    from ..world import exit_process

    exit_process(main())
