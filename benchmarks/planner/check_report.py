"""The one check's report: every table in sample and held out, how each held-out error was obtained, the fitted
constants, and the error bands per hardware class and layout family that ``shardwise predict`` and ``plan`` quote
(``shardwise.planner.error_band.BANDS``). Printed first by ``python benchmarks/planner_published.py``.
"""

from __future__ import annotations

import statistics
from typing import Any

from .published_check import TABLES, UNGRADED, Row, summary_lines

__all__ = ["bands", "check", "check_lines", "write_bands"]

Band = tuple[float, float, int, str]


def bands(held_out: dict[str, list[Row]]) -> dict[tuple[str, str], Band]:
    """``{(hardware class, layout family): (typical, worst, rows, tables)}`` from the held-out rows of every graded
    time table: typical = the median |error|, worst = the max, and per hardware class an ``"any layout"`` band over
    all its rows (what a family without rows of its own is quoted)."""
    groups: dict[tuple[str, str], list[tuple[str, float]]] = {}
    for table, rows in held_out.items():
        info = TABLES[table]
        if table in UNGRADED or info.metric != "time" or info.hardware == "any":
            continue
        for r in rows:
            groups.setdefault((info.hardware, r.family), []).append((table, r.error))
            groups.setdefault((info.hardware, "any layout"), []).append((table, r.error))
    out = {}
    for key, items in sorted(groups.items()):
        errs = [abs(e) for _, e in items]
        tables = ", ".join(dict.fromkeys(t for t, _ in items))
        out[key] = (round(statistics.median(errs), 3), round(max(errs), 3), len(errs), tables)
    return out


def check() -> dict[str, Any]:
    """Everything the report prints, as data: ``in_sample`` and ``held_out`` rows, ``how`` per table, each fitted
    constant's in-sample ``refit`` (what the presets should carry), ``bands``."""
    from .holdout import held_out
    from .published_check import all_errors

    in_sample = all_errors()
    out, how, refitted = held_out()
    held = {**in_sample, **out}
    return {"in_sample": in_sample, "held_out": held, "how": how, "refit": refitted, "bands": bands(held)}


def _shipped(name: str) -> float:
    from .holdout import FITTED

    return next(c.shipped for c in FITTED if c.name == name)


def check_lines(result: dict[str, Any] | None = None) -> list[str]:
    from .holdout import constants_lines

    result = result or check()
    lines = ["Every table (benchmarks/planner/published_check.py; tests/unit/test_planner_tables.py holds each graded "
             "one to a bound, in sample and held out):", "", *summary_lines(result["in_sample"], result["held_out"]),
             "", "Held out: " + "; ".join(f"{t}: {h}" for t, h in result["how"].items() if h != "nothing fitted")
             + "; every other table: nothing fitted (held-out = in-sample).", "", *constants_lines(),
             *[f"NOTE: {name} ships {c:g}, its in-sample fit is {v:g}: update the presets." for name, v in
               result["refit"].items() if (c := _shipped(name)) != v], "",
             "Error bands (held-out |error| of the graded time rows, by hardware class and layout family; what "
             "`shardwise predict` and `plan` quote):", "", "| hardware | family | typical | worst | rows | tables |",
             "|---|---|---|---|---|---|"]
    for (hw, fam), (typical, worst, n, tables) in result["bands"].items():
        lines.append(f"| {hw} | {fam} | ±{typical:.1%} | ±{worst:.1%} | {n} | {tables} |")
    return lines


def write_bands(result: dict[str, Any], path: str | None = None) -> str:
    """Rewrite the ``BANDS`` literal of ``shardwise/planner/error_band.py`` (or ``path``) with ``result``'s bands;
    returns the path. ``python benchmarks/planner_published.py --write-bands`` runs it after a change to the model
    (``tests/unit/test_planner_tables.py`` fails until the shipped bands are the check's)."""
    from pathlib import Path

    import importlib

    # the module, not ``shardwise.planner.error_band`` the function the package exports under the same name
    module = importlib.import_module("shardwise.planner.error_band")
    target = Path(path or str(module.__file__))
    text = target.read_text()
    head = "BANDS: dict[tuple[str, str], tuple[float, float, int, str]] = {\n"
    start = text.index(head) + len(head)
    end = text.index("\n}\n", start)
    body = []
    for (hw, fam), (typical, worst, n, tables) in result["bands"].items():
        key = "ANY_LAYOUT" if fam == "any layout" else f'"{fam}"'
        body.append(f'    ("{hw}", {key}): ({typical!r}, {worst!r}, {n}, "{tables}"),')
    target.write_text(text[:start] + "\n".join(body) + text[end:])
    return str(target)
