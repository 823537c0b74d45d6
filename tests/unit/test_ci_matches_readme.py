"""CI runs what the README tells a new user to run: the quick start's command lines, verbatim, in order."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("<!-- section:quickstart -->", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the README's quick start has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def ci_commands() -> list[str]:
    lines = (ROOT / ".ci" / "run").read_text().splitlines()
    return [line for line in lines if line.startswith("python3 -m venv")]


def test_ci_runs_the_readme_quick_start_verbatim():
    readme = readme_commands()
    assert len(readme) == 2 and readme[0].endswith("shardwise train") and "pytest" in readme[1]
    assert ci_commands() == readme


def test_main_job_installs_no_extras_and_runs_first():
    first, second = readme_commands()
    assert 'pip install -e . ' in first + " " and "[" not in first  # no extras: a fresh user's environment
    assert '".[dev]"' in second
    ci = (ROOT / ".ci" / "run").read_text()
    # each command starts from a fresh virtual environment: the main job cannot borrow the test extras
    assert ci.index(first) < ci.index("rm -rf .venv\n" + second)
