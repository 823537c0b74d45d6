"""Mesh cache inside a rank process: building a Mesh creates process groups, so tests reuse them."""

from __future__ import annotations

import shardwise as sw

_CACHE: dict[tuple, sw.Mesh] = {}


def mesh(debug: bool = False, **axes: int) -> sw.Mesh:
    """The cached ``Mesh(**axes)`` of this rank (every rank asks for the same meshes in the same order)."""
    key = (debug, tuple(axes.items()))
    if key not in _CACHE:
        _CACHE[key] = sw.Mesh(debug=debug, **axes)
    return _CACHE[key]
