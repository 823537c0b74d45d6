"""Aggregation and output of the fault campaign (``benchmarks/faults_campaign.py``): per-kind summary, a rich table, Markdown."""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["summarize", "print_table", "markdown", "COLUMNS"]

COLUMNS = ("kind", "trials", "max_exit_s", "named_pct", "loadable_pct", "resumed_identical_pct", "detected_pct",
           "extra")
_HEADERS = ("kind", "trials", "max exit (s)", "named", "loadable", "resumed identical", "detected", "kind-specific")


def _pct(values: Sequence[Any]) -> float | None:
    """Percentage of True among the applicable (non-None) values; None when none applies."""
    known = [v for v in values if v is not None]
    return round(100.0 * sum(bool(v) for v in known) / len(known), 1) if known else None


def _extra(kind: str, rows: list[dict[str, Any]]) -> str:
    """The kind's own measurement, as 'k/n what'."""
    n = len(rows)
    if kind == "kill-in-save":
        return f"{sum(bool(r['in_save']) for r in rows)}/{n} killed with a save in progress"
    if kind == "kill-launcher":
        return f"{sum(bool(r['quiet_after']) for r in rows)}/{n} no checkpoint change in 5 s after"
    if kind == "sigstop-rank":
        return f"{sum(bool(r['within_goal']) for r in rows)}/{n} exited within timeout_s + 10 s"
    if kind == "corrupt-piece":
        return "verify raises, export exits 2 (one line), resume warns + falls back"
    return ""


def summarize(trials: list[dict[str, Any]], kinds: Sequence[str]) -> list[dict[str, Any]]:
    """One row per kind: trials, max exit time, % named / loadable / resumed identical / detected."""
    out = []
    for kind in kinds:
        rows = [t for t in trials if t["kind"] == kind]
        exits = [t["exit_s"] for t in rows if t["exit_s"] is not None and kind != "corrupt-piece"]
        out.append({"kind": kind, "trials": len(rows), "max_exit_s": max(exits) if exits else None,
                    "named_pct": _pct([t["named"] for t in rows]),
                    "loadable_pct": _pct([t["loadable"] for t in rows]),
                    "resumed_identical_pct": _pct([t["resumed_identical"] for t in rows]),
                    "detected_pct": _pct([t["detected"] for t in rows]),
                    "extra": _extra(kind, rows)})
    return out


def _cell(value: Any, pct: bool) -> str:
    if value is None:
        return "n/a"
    return f"{value:g}%" if pct else (f"{value:.2f}" if isinstance(value, float) else str(value))


def _cells(row: dict[str, Any]) -> list[str]:
    return [_cell(row[c], c.endswith("_pct")) for c in COLUMNS]


def print_table(summary: list[dict[str, Any]], title: str) -> None:
    """The summary as a rich table on stdout."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for h in _HEADERS:
        table.add_column(h, justify="left" if h in ("kind", "kind-specific") else "right")
    for row in summary:
        table.add_row(*_cells(row))
    Console(width=160).print(table)


def markdown(summary: list[dict[str, Any]]) -> str:
    """The summary as a Markdown table."""
    lines = ["| " + " | ".join(_HEADERS) + " |", "|" + "|".join("---" for _ in _HEADERS) + "|"]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in summary]
    return "\n".join(lines) + "\n"
