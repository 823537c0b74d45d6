"""What ships is what users run: the installed package is ``shardwise/`` alone; the measurement campaigns and the
published tables live in ``benchmarks/`` (a checkout-only package) and nothing in ``shardwise/`` imports them."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def test_only_shardwise_is_packaged():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["shardwise*"]


def test_the_package_never_imports_the_benchmarks():
    wrong = []
    for path in sorted((ROOT / "shardwise").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                      if n == "benchmarks" or n.startswith("benchmarks.")]
    assert not wrong, wrong


def test_the_campaigns_are_scripts_outside_the_package():
    for script in ("planner_published.py", "planner_search_measured.py", "planner_rescore.py", "faults_campaign.py"):
        assert (ROOT / "benchmarks" / script).is_file(), script
    for moved in ("planner/published.py", "bench/faults.py", "bench/planner_search.py", "bench/calibrate.py"):
        assert not (ROOT / "shardwise" / moved).exists(), moved
    from shardwise.cli.main import BENCHES

    assert "faults" not in BENCHES and "planner" in BENCHES
