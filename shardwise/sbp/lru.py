"""A small least-recently-used map for the process-wide caches of op dispatch.

Those caches are keyed by what a program does (op, input specs, arguments), so a long-lived process that keeps
meeting new shapes (varying sequence lengths, many meshes in one test session) would grow them forever. A
fixed bound keeps memory flat; a steady training loop repeats the same few hundred keys and never evicts.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Hashable, TypeVar

__all__ = ["LRU"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``maxsize`` entries; ``put`` beyond that drops the least recently read or written one.
    Not thread-safe beyond what the GIL gives single ``OrderedDict`` operations (a lost update only costs a
    recomputation: entries are pure functions of their keys)."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"LRU maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recent), or None."""
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self.maxsize:
            self._data.popitem(last=False)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data
