"""Shared fixtures: persistent spawned worlds of CPU ranks, one per world size, reused by every dist test."""

from __future__ import annotations

from typing import Iterator

import pytest

from shardwise.testing.local_world import LocalWorld


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
            w.close()


@pytest.fixture(scope="session")
def worlds() -> Iterator[Worlds]:
    w = Worlds()
    yield w
    w.close()
