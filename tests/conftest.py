"""Shared fixtures: persistent spawned worlds of CPU ranks, one per world size, reused by every dist test."""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from typing import Iterator

import pytest

# The suite starts several hundred Python processes (launchers, torchrun ranks, spawned worlds). Where the
# environment forbids bytecode caches (PYTHONDONTWRITEBYTECODE, as on our CI machines) every one of them
# recompiles shardwise from source: ~0.2 s of a core per process, ~0.4 s per two-rank launch. The session keeps
# its caches in a temporary directory instead (nothing is written into the checkout or the environment).
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None or sys.dont_write_bytecode:
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="shardwise-test-pyc-")
    sys.dont_write_bytecode = False
    atexit.register(shutil.rmtree, sys.pycache_prefix, ignore_errors=True)

# Every rank the suite starts (spawned worlds, launched jobs) computes with one thread, as torchrun gives each of
# several ranks per node: left at torch's default, each of 2-8 ranks on a small machine runs one thread per core,
# and the oversubscribed OpenMP threads spin against each other (a third of the suite's time on 2 cores). Set
# before torch is imported here, and inherited by every subprocess; a value given in the environment is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The suite checks values, not resident memory: its ranks keep glibc's default heap (fast reuse of freed blocks)
# instead of the bounded retention sw.init sets on CPU ranks (shardwise/allocator.py), which costs a page fault per
# page of every large tensor. Tests of memory itself set SHARDWISE_MALLOC for their own ranks.
os.environ.setdefault("SHARDWISE_MALLOC", "keep")

from shardwise.testing.local_world import LocalWorld  # noqa: E402

# The campaign tooling and the published tables live outside the package, in benchmarks/ (a checkout-only
# ``benchmarks`` package): the tests that check them import it from the repository root.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)


# A calibration in the user's cache (``shardwise calibrate`` writes ~/.cache/shardwise/hardware-*.json) would
# switch training's default algorithm="auto" away from native and change predictions: the suite never sees one.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="shardwise-test-cache-")


class Worlds:
    """Lazily started ``LocalWorld`` s keyed by size; all closed at the end of the session."""

    def __init__(self) -> None:
        self._worlds: dict[int, LocalWorld] = {}

    def get(self, n: int) -> LocalWorld:
        if n not in self._worlds:
            self._worlds[n] = LocalWorld(n, collective_timeout_s=60)
        return self._worlds[n]

    def close(self) -> None:
        for w in self._worlds.values():
            w.stop()  # all worlds' ranks exit at once, then each is joined
        for w in self._worlds.values():
            w.close()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Worlds]:
    w = Worlds()
    yield w
    w.close()


@pytest.fixture(scope="module")
def one_rank_mesh() -> Iterator["object"]:
    """A ``Mesh(dp=1, tp=1)`` in a world of this one process (``sw.init`` without torchrun), for checks that
    need an initialised job but no peers; left initialised if it already was."""
    import torch

    from shardwise import world
    from shardwise.mesh import Mesh

    was = torch.distributed.is_initialized()
    world.init(backend="gloo")
    yield Mesh(dp=1, tp=1)
    if not was:
        world.shutdown()
