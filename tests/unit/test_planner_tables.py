"""The planner against every published table at once (``benchmarks/planner/published_check.py``): each graded
table is held to its recorded bound on the median and the max |error|, so a change that improves one table and
degrades another fails here, naming the table and the row.

The bounds are the errors recorded when the check was introduced, plus half a point: they are a ratchet (lower them
when a change improves a table), not the goal. The goal — every graded row within 15 %, each table's median within
8 % — is the strict xfail below, which starts failing (and must then become a plain test) once it holds.
"""

from __future__ import annotations

import statistics

import pytest

from benchmarks.planner.published_check import UNGRADED, table_errors
from benchmarks.planner.published_report import published_tables

# table: (max |error|, median |error|), recorded + 0.5 point
BOUNDS = {
    "megatron-table1": (0.098, 0.059),
    "korthikanti-table5": (0.040, 0.015),
    "narayanan-table2-ptdp": (0.111, 0.087),
    "llama3-table4": (0.126, 0.038),
    "mcore-weak-scaling": (0.492, 0.136),
    "zero-table1-memory": (0.008, 0.006),
}


@pytest.fixture(scope="module")
def errors() -> dict[str, list[tuple[str, float]]]:
    return table_errors(published_tables()[1])


def test_every_table_is_graded_or_says_why(errors):
    assert set(errors) == set(BOUNDS) | set(UNGRADED), sorted(set(errors) ^ (set(BOUNDS) | set(UNGRADED)))
    assert all(len(rows) >= 3 for rows in errors.values())


@pytest.mark.parametrize("table", sorted(BOUNDS))
def test_table_within_its_recorded_bound(errors, table):
    worst, median = BOUNDS[table]
    over = [(row, f"{e:+.1%}") for row, e in errors[table] if abs(e) > worst]
    assert not over, f"{table}: rows over the recorded {worst:.1%}: {over}"
    med = statistics.median(abs(e) for _, e in errors[table])
    assert med <= median, f"{table}: median |error| {med:.1%} over the recorded {median:.1%}"


@pytest.mark.xfail(strict=True, reason="Megatron-Core weak scaling: tp 1 row +48.7 %, tp 2 +27.1 %, median 13.1 %")
def test_goal_every_graded_row_within_15_percent_and_median_within_8(errors):
    for table in BOUNDS:
        rows = errors[table]
        assert all(abs(e) <= 0.15 for _, e in rows), (table, [(r, e) for r, e in rows if abs(e) > 0.15])
        assert statistics.median(abs(e) for _, e in rows) <= 0.08, table
