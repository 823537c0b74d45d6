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
    "megatron-table1": ((0.097, 0.029), (0.083, 0.061)),
    "korthikanti-table5": ((0.116, 0.082), (0.138, 0.101)),
    "narayanan-table2-ptdp": ((0.047, 0.024), (0.111, 0.088)),
    "llama3-table4": ((0.199, 0.084), (0.230, 0.116)),
    "mcore-weak-scaling": ((0.340, 0.073), (0.362, 0.092)),
    "moe-bridge-bf16": ((0.590, 0.522), (0.590, 0.522)),
    "zero-table1-memory": ((0.008, 0.007), (0.008, 0.007)),
    "korthikanti-activations": ((0.006, 0.005), (0.006, 0.005)),
    "h200-calibrated": ((0.164, 0.024), (0.164, 0.024)),
    "h200-quick-probe": ((0.284, 0.129), (0.284, 0.129)),
    "cpu-calibrated": ((0.146, 0.060), (0.146, 0.060)),
    "cpu-memory": ((0.117, 0.052), (0.117, 0.052)),
}
MISSES_GOAL = {"korthikanti-table5", "narayanan-table2-ptdp", "llama3-table4", "mcore-weak-scaling", "moe-bridge-bf16",
               "h200-calibrated", "h200-quick-probe"}
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
    # fake tables whose errors are linear in the constant: one table alone has a unique best grid value; two
    # tables pulling apart leave a flat optimum, broken towards the prior
    c = FITTED[0]
    grid = {v: {"a": [Row("r", 1.1 * v - 1, "f")], "b": [Row("r", 0.8 * v - 1, "f")]} for v in c.grid}
    assert fit(c, grid, ["a"]) == min(c.grid, key=lambda v: abs(math.log(1.1 * v)))
    assert fit(c, grid, ["a"]) == 0.90
    assert objective(grid[0.9], ["a"]) == pytest.approx(abs(math.log(0.99)))
    # |log 1.1v| + |log 0.8v| is log(1.375) for every v in [1/1.1, 1/0.8]: the grid's values there tie
    assert fit(c, grid, ["a", "b"]) == c.prior
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


def test_write_bands_rewrites_only_the_bands_literal(result, tmp_path):
    import ast
    import importlib

    from benchmarks.planner.check_report import write_bands

    source = importlib.import_module("shardwise.planner.error_band").__file__
    copy = tmp_path / "error_band.py"
    text = open(source).read()
    copy.write_text(text.replace('("A100", ANY_LAYOUT): (', '("A100", ANY_LAYOUT): (9.0 + ', 1))  # a stale band
    assert write_bands(result, str(copy)) == str(copy)
    written = copy.read_text()
    assert written == text  # the check's bands are the shipped ones (test above): the stale one is gone, nothing else moved
    tree = ast.parse(written)
    literal = next(n.value for n in ast.walk(tree) if isinstance(n, ast.AnnAssign)
                   and getattr(n.target, "id", "") == "BANDS")
    assert len(literal.keys) == len(result["bands"])
