"""``shardwise calibrate --nproc N [--out FILE] [--quick]``: measure this machine into one hardware JSON file.

The measuring lives in the bench layer (``shardwise/bench/calibrate.py``, the probe in
``shardwise/bench/probe.py``); the file's schema and its reader in ``shardwise/comm/hardware.py``.
"""

from __future__ import annotations

from ..bench.calibrate import add_arguments, main

__all__ = ["add_arguments", "main"]
