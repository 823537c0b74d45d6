"""The documentation holds: every link and repo path it names exists, the README stays a front door, and the
Python examples marked ``<!-- example: ranks=N -->`` run.

Examples: a ```python fence right after the marker comment. ranks=1 examples run in one subprocess, each
``exec``-ed in a fresh namespace (``sw.init()`` without torchrun makes a world of one process); examples of
N >= 2 ranks are batched into one script per N, each again in its own namespace, run by
``shardwise run -n N``. A failure names the file and line of the example.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!-- example: ranks=(\d+) -->\n```python\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
REPO_PATH = re.compile(r"^(shardwise|docs|benchmarks|tests)/[\w./-]*$")
PLACEHOLDER = re.compile(r"\b[A-Z]{2,}\b")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def examples() -> list[tuple[str, int, str]]:
    """(where, ranks, code) of every marked example, in document order."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in MARKER.finditer(text):
            line = text.count("\n", 0, m.start()) + 2
            out.append((f"{_rel(doc)}:{line}", int(m.group(1)), m.group(2)))
    return out


def test_docs_exist():
    names = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert {"training.md", "meshes-and-collectives.md", "sbp.md", "data-parallelism.md", "zero.md",
            "tensor-parallelism.md", "pipelines.md", "failures.md", "benchmarks.md"} <= names
    for page in (ROOT / "docs").glob("*.md"):
        assert "\n## What is tested and measured\n" in page.read_text(), f"{page.name} lacks the tested section"


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 250, f"README.md has {len(lines)} lines; move detail to docs/"


def test_links_and_paths_exist():
    missing = []
    for doc in DOCS:
        text = doc.read_text()
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                missing.append(f"{_rel(doc)}: link {target}")
        prose = FENCE.sub("", text)  # paths inside code blocks are commands' arguments (runs/..., comm.json)
        for span in CODE.findall(prose):
            path = span.split("::", 1)[0].rstrip("/")
            if PLACEHOLDER.search(path):  # shardwise/cli/NAME.py: a pattern, not a file
                continue
            if REPO_PATH.match(path) and not (ROOT / path).exists():
                missing.append(f"{_rel(doc)}: path {span}")
    assert not missing, "named in the docs but not in the repository:\n" + "\n".join(missing)


def test_there_are_examples_and_the_readme_tour_runs():
    found = examples()
    assert sum(1 for where, _, _ in found if where.startswith("README.md")) >= 5
    assert any(ranks == 1 for _, ranks, _ in found)


_DRIVER = """
import sys, traceback
examples = {examples!r}
failed = []
for where, code in examples:
    try:
        exec(compile(code, where, "exec"), {{"__name__": "__example__"}})
    except BaseException:
        failed.append(where)
        traceback.print_exc()
        print(f"EXAMPLE FAILED: {{where}}", file=sys.stderr, flush=True)
if failed:
    sys.exit(1)
"""


def _run(ranks: int, batch: list[tuple[str, str]], tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / f"examples_{ranks}.py"
    script.write_text(textwrap.dedent(_DRIVER).format(examples=batch))
    if ranks == 1:
        cmd = [sys.executable, str(script)]
    else:
        cmd = [sys.executable, "-m", "shardwise.cli", "run", "-n", str(ranks), str(script)]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("ranks", sorted({r for _, r, _ in examples()}))
def test_examples_run(ranks, tmp_path):
    batch = [(where, code) for where, r, code in examples() if r == ranks]
    proc = _run(ranks, batch, tmp_path)
    assert proc.returncode == 0, (f"{ranks}-rank examples failed:\n"
                                  + "\n".join(l for l in proc.stderr.splitlines() if "EXAMPLE FAILED" in l)
                                  + "\n" + proc.stderr[-6000:])
