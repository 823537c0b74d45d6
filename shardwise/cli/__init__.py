"""The ``shardwise`` command line: one module per command (``run``, ``train``, ``verify``, ``export``, ``plot``,
``schedule``, ``bench``), wired in ``main.py``."""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
