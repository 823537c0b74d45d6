"""Leave-one-table-out: every constant fitted to data is fitted with the table under test held out.

A fitted constant (``Fitted``) belongs to one hardware class and changes that class's presets
(``shardwise.planner.hardware.PRESETS``) while the tables are evaluated. Its shipped value is fitted on every graded
table of its class (the in-sample errors); the held-out error of a table is its error with the constant refitted on
the class's *other* graded tables. A table whose class has no fitted constant, or only itself to fit on, has
held-out = in-sample where nothing was fitted, and "no other table" where the constant falls back to its prior
(``Fitted.prior``, the value before any fitting) — the report says which.

Fitting: a grid search minimising the mean over the fitting tables of each table's median |log(1 + error)| (every
table weighs the same whatever its row count; over- and under-prediction weigh alike). Pure: the planner only.
"""

from __future__ import annotations

import math
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterator

from shardwise.planner import hardware as _hardware
from shardwise.planner.hardware import Hardware

from .published_check import TABLES, UNGRADED, Row, all_errors

__all__ = ["Fitted", "FITTED", "objective", "fit", "evaluate", "held_out", "constants_lines"]


@dataclass(frozen=True)
class Fitted:
    name: str
    hardware: str
    """The hardware class (``published_check.TABLES``' vocabulary) whose presets it changes."""
    presets: tuple[str, ...]
    grid: tuple[float, ...]
    prior: float
    """The value before fitting (what a table with no other table of its class to fit on is judged with)."""
    apply: Callable[[Hardware, float], Hardware]
    meaning: str

    @property
    def shipped(self) -> float:
        """The value the presets carry now (read back from the first preset)."""
        return self.read(_hardware.PRESETS[self.presets[0]])

    def read(self, hw: Hardware) -> float:
        return hw.sustained_fraction


def _sustained(hw: Hardware, value: float) -> Hardware:
    return replace(hw, sustained_fraction=value)


_GRID = tuple(round(0.60 + 0.02 * i, 2) for i in range(21))  # 0.60 … 1.00
FITTED: tuple[Fitted, ...] = (
    Fitted("sustained_fraction (A100)", "A100", ("a100-80g-sxm",), _GRID, 1.0, _sustained,
           "the share of its kernels' published throughput an A100 sustains through a long training run"),
    Fitted("sustained_fraction (H100/H200)", "H100/H200", ("h100-80g-sxm", "h200-141g-sxm"), _GRID, 1.0,
           _sustained, "the share of its kernels' published throughput an H100 sustains through a long training run"),
)
"""The constants fitted to tables (``docs/planner.md`` lists every constant, fitted or not, with its source)."""


@contextmanager
def _presets(values: dict[str, float]) -> Iterator[None]:
    saved = dict(_hardware.PRESETS)
    try:
        for c in FITTED:
            if c.name in values:
                for name in c.presets:
                    _hardware.PRESETS[name] = c.apply(saved[name], values[c.name])
        yield
    finally:
        _hardware.PRESETS.clear()
        _hardware.PRESETS.update(saved)


def evaluate(values: dict[str, float], tables: list[str] | None = None) -> dict[str, list[Row]]:
    """``tables``' rows (default: every table) with the fitted constants set to ``values`` (the others as
    shipped)."""
    with _presets(values):
        return all_errors(tables)


def objective(errors: dict[str, list[Row]], tables: list[str]) -> float:
    """Mean over ``tables`` of the table's median |log(1 + error)| (module doc)."""
    return statistics.fmean(statistics.median(abs(math.log1p(r.error)) for r in errors[t]) for t in tables)


def _class_tables(hardware: str) -> list[str]:
    return [t for t, info in TABLES.items() if info.hardware == hardware]


def _graded(hardware: str) -> list[str]:
    """The tables a constant of ``hardware`` is fitted on: its graded time tables of dense models (a mixture of
    experts' missing costs — the routing's host sync, permutations, grouped GEMMs — are not what a dense kernel
    constant describes, so those tables are always held out)."""
    return [t for t in _class_tables(hardware) if t not in UNGRADED and TABLES[t].metric == "time"
            and not t.startswith("moe-")]


def fit(constant: Fitted, grid_errors: dict[float, dict[str, list[Row]]], tables: list[str]) -> float:
    """The grid value that minimises ``objective`` over ``tables`` (the prior when ``tables`` is empty)."""
    if not tables:
        return constant.prior
    return min(constant.grid, key=lambda v: (objective(grid_errors[v], tables), abs(v - constant.prior)))


def held_out() -> tuple[dict[str, list[Row]], dict[str, str], dict[str, float]]:
    """``(rows of every table with each fitted constant refitted without it, {table: how}, {constant: its
    in-sample fit})``. Tables no fitted constant touches keep their in-sample rows (``how``: "nothing fitted"); the
    in-sample fit (on every graded table of the class) is what the presets should ship."""
    shipped = {c.name: c.shipped for c in FITTED}
    out = evaluate(shipped)
    how = {t: "nothing fitted" for t in out}
    refitted = {}
    for c in FITTED:
        grid_errors = {v: evaluate({**shipped, c.name: v}, _class_tables(c.hardware)) for v in c.grid}
        tables = _graded(c.hardware)
        refitted[c.name] = fit(c, grid_errors, tables)
        for t in [t for t in out if TABLES[t].hardware == c.hardware]:
            others = [o for o in tables if o != t]
            value = fit(c, grid_errors, others)
            out[t] = grid_errors[value][t]
            how[t] = (f"{c.name} = {value:g} fitted on {', '.join(others)}" if others
                      else f"{c.name} = prior {value:g} (no other table of its class)")
    return out, how, refitted


def constants_lines() -> list[str]:
    """The fitted constants: shipped value, what it means, the tables it is fitted on."""
    lines = ["| fitted constant | value | fitted on | meaning |", "|---|---|---|---|"]
    for c in FITTED:
        lines.append(f"| {c.name} | {c.shipped:g} | {', '.join(_graded(c.hardware))} | {c.meaning} |")
    return lines
