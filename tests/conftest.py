"""Shared fixtures: persistent spawned worlds of CPU ranks, one per world size, reused by every dist test."""

from __future__ import annotations

import os
import tempfile
from typing import Iterator

import pytest

from shardwise.testing.local_world import LocalWorld


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
