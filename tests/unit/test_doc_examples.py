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
    assert sum(1 for where, _, _ in found if where.startswith("README.md")) >= 1
    assert any(ranks == 1 for _, ranks, _ in found)
    # each strategy's page opens with a complete example that runs as it stands
    for page in ("data-parallelism", "zero", "tensor-parallelism", "pipelines", "sbp", "auto"):
        assert any(where.startswith(f"docs/{page}.md") for where, _, _ in found), f"docs/{page}.md has no example"


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


# Every Markdown file of the repository (the docs, RESULTS and its log, examples' notes), for links and anchors.
SKIP_DIRS = {".venv", "runs", "site", "node_modules", ".git", ".pytest_cache"}
ALL_MD = sorted(p for p in ROOT.rglob("*.md")
                if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts[:-1])
                and not any(part.endswith(".egg-info") for part in p.parts))
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)               # code spans keep their text
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)     # links keep their text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)                     # \w keeps letters, digits, '_' (any script)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    """Every anchor a link may name in ``doc``: headings outside code fences (repeats get -1, -2, ...) and
    explicit ``<a id=...>`` tags."""
    text = FENCE.sub("", doc.read_text())
    seen: dict[str, int] = {}
    out = set(HTML_ANCHOR.findall(text))
    for m in HEADING.finditer(text):
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        out.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return out


def test_github_slug_rules():
    assert github_slug("Data parallelism: `shardwise bench dp`") == "data-parallelism-shardwise-bench-dp"
    assert github_slug("Planner search: the fastest (`sw.planner.search`)") == \
        "planner-search-the-fastest-swplannersearch"
    assert github_slug("ZeRO 1–3, [link](x.md)") == "zero-13-link"


def test_every_link_and_anchor_resolves():
    """Relative links in every Markdown file of the repository name a file that exists, and a ``#anchor`` a
    heading (or ``<a id>``) of that file."""
    assert len(ALL_MD) > 20
    cache: dict[Path, set[str]] = {}
    broken = []
    for doc in ALL_MD:
        for target in LINK.findall(FENCE.sub("", doc.read_text())):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{_rel(doc)}: link {target} (no such file)")
            elif anchor and dest.suffix == ".md":
                if anchor not in cache.setdefault(dest, anchors(dest)):
                    broken.append(f"{_rel(doc)}: link {target} (no heading with anchor #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


DATED = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b|\b(?:January|February|March|April|May|June|July|August|"
                   r"September|October|November|December) 20\d\d\b|\bthis VM\b|\bon this machine\b")


def test_user_docs_carry_no_dates_or_machine_remarks():
    """README and docs/ state what is true now; when and where a number was measured belongs to
    benchmarks/RESULTS.md and its log."""
    found = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for i, line in enumerate(doc.read_text().splitlines(), 1):
            if DATED.search(line):
                found.append(f"{_rel(doc)}:{i}: {line.strip()[:120]}")
    assert not found, "dates or machine remarks in user docs:\n" + "\n".join(found)


def test_the_date_rule_can_fail():
    assert DATED.search("measured on 2026-11-26 here") and DATED.search("on this VM, 2 cores")
    assert not DATED.search("a 2-rank run of 2026 tokens")
