"""The run summary's "memory ledger" row, from the ranks' ``memory_ledger`` (``memory_ledger.py``). Apart from
that module so that ``metrics.py`` reads it without importing the planner side of the ledger. Pure."""

from __future__ import annotations

from typing import Any

from ..planner.units import format_bytes

__all__ = ["ledger_row"]


def ledger_row(ranks: list[dict[str, Any]]) -> tuple[str, str] | None:
    """The run summary's "memory ledger" row: the worst rank's whole-run peak over its floor, the phase of its
    peak and its biggest named excess; None when no rank has a ledger with a floor."""
    books = [(r["rank"], r["memory_ledger"]) for r in ranks if (r.get("memory_ledger") or {}).get("ratio")]
    if not books:
        return None
    rank, book = max(books, key=lambda rb: rb[1]["ratio"])
    text = (f"r{rank}: peak {format_bytes(book['whole_peak'])} above the bare runtime = {book['ratio']:.2f}x the "
            f"floor {format_bytes(book['floor']['total'])} (largest term {book['floor']['largest']}); "
            f"peak in {book['peak_phase'] or 'n/a'}")
    if book.get("biggest_excess"):
        phase, name, amount = book["biggest_excess"]
        text += f"; biggest excess {format_bytes(amount)} {name} ({phase})"
    if book.get("held_on_entry"):
        text += f"; {format_bytes(book['held_on_entry'])} held on entry to {book['peak_phase']}"
    return "memory ledger", text
