"""``LocalWorld``: spawn a world of CPU ranks once and run many checks in it (for shardwise's tests and yours)."""

from .local_world import LocalWorld

__all__ = ["LocalWorld"]
