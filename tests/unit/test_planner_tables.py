"""The planner against every published and measured table at once (``benchmarks/planner/published_check.py``,
``check_report.py``): each graded table is held to its recorded bound on the median and the max |error|, in sample
and held out (leave-one-table-out, ``holdout.py``), so a change that improves one table and degrades another fails
here, naming the table and the row; the error bands ``shardwise predict`` and ``plan`` quote are the ones the check
computes.

The bounds are the errors recorded when the check last changed, plus half a point: a ratchet (lower them when a
change improves a table), not the goal. The goal — every graded row within 15 %, each table's median within 8 % —
is the strict xfail below for the tables that do not meet it yet, and a plain test for those that do.
"""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.planner.check_report import check
from benchmarks.planner.holdout import FITTED, fit, objective
from benchmarks.planner.published_check import TABLES, UNGRADED, Row

# table: (max |error|, median |error|) in sample, then held out; recorded + 0.5 point
BOUNDS = {
    "megatron-table1": ((0.098, 0.059), (0.082, 0.061)),
    "korthikanti-table5": ((0.040, 0.015), (0.137, 0.101)),
    "narayanan-table2-ptdp": ((0.111, 0.087), (0.111, 0.087)),
    "llama3-table4": ((0.126, 0.038), (0.108, 0.076)),
    "mcore-weak-scaling": ((0.492, 0.136), (0.469, 0.121)),
    "moe-bridge-bf16": ((0.786, 0.681), (0.669, 0.570)),
    "zero-table1-memory": ((0.008, 0.006), (0.008, 0.006)),
    "h200-calibrated": ((0.163, 0.023), (0.163, 0.023)),
    "h200-quick-probe": ((0.283, 0.129), (0.283, 0.129)),
    "cpu-calibrated": ((0.146, 0.059), (0.146, 0.059)),
    "cpu-memory": ((0.116, 0.052), (0.116, 0.052)),
}
MISSES_GOAL = {"mcore-weak-scaling", "moe-bridge-bf16", "h200-calibrated", "h200-quick-probe"}
"""Graded tables not yet within the goal (named in docs/planner.md with the reason)."""


@pytest.fixture(scope="module")
def result() -> dict:
    return check()


def _over(rows: list[Row], worst: float) -> list[tuple[str, str]]:
    return [(r.name, f"{r.error:+.1%}") for r in rows if abs(r.error) > worst]


def test_every_table_is_graded_or_says_why(result):
    tables = set(result["in_sample"])
    assert tables == set(TABLES), sorted(tables ^ set(TABLES))
    assert tables == set(BOUNDS) | set(UNGRADED), sorted(tables ^ (set(BOUNDS) | set(UNGRADED)))
    assert all(len(rows) >= 2 for rows in result["in_sample"].values())


@pytest.mark.parametrize("table", sorted(BOUNDS))
@pytest.mark.parametrize("kind", ["in_sample", "held_out"])
def test_table_within_its_recorded_bound(result, table, kind):
    (worst, median) = BOUNDS[table][0 if kind == "in_sample" else 1]
    rows = result[kind][table]
    assert not _over(rows, worst), f"{table} ({kind}): rows over the recorded {worst:.1%}: {_over(rows, worst)}"
    med = statistics.median(abs(r.error) for r in rows)
    assert med <= median, f"{table} ({kind}): median |error| {med:.1%} over the recorded {median:.1%}"


def _meets_goal(rows: list[Row]) -> bool:
    return all(abs(r.error) <= 0.15 for r in rows) and statistics.median(abs(r.error) for r in rows) <= 0.08


@pytest.mark.parametrize("table", sorted(set(BOUNDS) - MISSES_GOAL))
def test_goal_every_row_within_15_percent_and_median_within_8(result, table):
    for kind in ("in_sample", "held_out"):
        rows = result[kind][table]
        assert _meets_goal(rows), (table, kind, _over(rows, 0.15))


@pytest.mark.parametrize("table", sorted(MISSES_GOAL))
@pytest.mark.xfail(strict=True, reason="named in docs/planner.md: the goal is not met yet")
def test_goal_not_yet_met(result, table):
    assert all(_meets_goal(result[kind][table]) for kind in ("in_sample", "held_out"))


def test_nothing_is_fitted_to_the_row_it_is_judged_by(result):
    # a table no fitted constant touches is judged in sample; every other table names the tables it was fitted on,
    # and never itself
    for table, how in result["how"].items():
        if how == "nothing fitted":
            assert result["held_out"][table] == result["in_sample"][table]
            continue
        fitted_on = how.split(" fitted on ")[-1] if " fitted on " in how else ""
        assert table not in fitted_on.split(", "), (table, how)


def test_fit_picks_the_grid_value_that_minimises_the_objective():
    # two fake tables whose errors are linear in the constant: the minimum of the mean median |log| is found
    c = FITTED[0]
    grid = {v: {"a": [Row("r", 1.1 * v - 1, "f")], "b": [Row("r", 0.9 * v - 1, "f")]} for v in c.grid}
    best = fit(c, grid, ["a", "b"])
    assert best == min(c.grid, key=lambda v: abs(math.log(1.1 * v)) + abs(math.log(0.9 * v)))
    assert objective(grid[best], ["a"]) == pytest.approx(abs(math.log1p(1.1 * best - 1)))
    assert fit(c, grid, []) == c.prior


def test_the_shipped_constants_are_the_in_sample_fit(result):
    assert result["refit"] == {c.name: c.shipped for c in FITTED}


def test_the_bands_users_see_are_the_checks(result):
    from shardwise.planner.error_band import BANDS, BANDS_HELD_OUT

    assert BANDS_HELD_OUT
    assert set(BANDS) == set(result["bands"])
    for key, (typical, worst, n, tables) in result["bands"].items():
        assert BANDS[key][:3] == pytest.approx((typical, worst, n), abs=0.0015), key
        assert BANDS[key][3] == tables, key
