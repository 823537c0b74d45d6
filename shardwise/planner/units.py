"""Memory as the planner's outputs print it: binary units (KiB, MiB, GiB), the units ``shardwise train``'s own
reports use and the ones a device's memory is counted in (an 80 GiB GPU has 80 × 2^30 bytes). Pure."""

from __future__ import annotations

__all__ = ["GIB", "MIB", "format_bytes"]

GIB = float(1 << 30)
MIB = float(1 << 20)


def format_bytes(n: float, digits: int = 1) -> str:
    """``n`` bytes in the largest binary unit below it, e.g. ``format_bytes(3 * 2**30) == "3.0 GiB"`` (``digits``
    decimals; whole bytes below 1 KiB)."""
    value = float(n)
    if abs(value) < 1024:
        return f"{value:.0f} B"
    unit = "KiB"
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024.0)):
        if abs(value) >= size:
            break
    return f"{value / size:.{digits}f} {unit}"
