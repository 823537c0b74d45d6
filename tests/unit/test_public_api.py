"""One public API, one name per idea (ARCHITECTURE.md, "Public API").

* Everything the documentation and the examples use is public: every Python code block of README.md,
  ARCHITECTURE.md and docs/*.md and every ``.py`` under examples/ imports only the public modules
  (``shardwise`` and ``shardwise.{models,comm,planner,schedules}``), only names in their ``__all__``, and reaches
  ``sw.a`` / ``sw.a.b`` only through ``__all__``. Pure ``ast``: nothing is run.
* Every name in a public module's ``__all__`` exists and has a docstring.
* The renamed ideas keep their old names as aliases of the very same objects.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import textwrap
import warnings
from pathlib import Path

import pytest

import shardwise as sw

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", ROOT / "ARCHITECTURE.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").rglob("*.py"))
PUBLIC = ("shardwise", "shardwise.models", "shardwise.comm", "shardwise.planner", "shardwise.schedules")
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
IMPORT_LINE = re.compile(r"^\s*(from shardwise[\w.]* import [\w, ]+|import shardwise[\w.]*( as \w+)?(, *\w+)*)\s*$")

ALIASES = [  # (old name, new name): the old one keeps working as the same object
    ("shardwise.Plan", "shardwise.ParallelizePlan"),
    ("shardwise.planner.Plan", "shardwise.planner.Layout"),
    ("shardwise.Broadcast", "shardwise.Replicate"),
]


def _exports(module: str) -> set[str]:
    return set(importlib.import_module(module).__all__)


def _public_module(name: str) -> bool:
    return name in PUBLIC


def violations(source: str, where: str, first_line: int = 1) -> list[str]:
    """Every use of a non-public shardwise name in ``source``, as ``where:line: what``."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # local name -> the shardwise module it is
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "shardwise":
                    continue
                if not _public_module(a.name):
                    found.append((node.lineno, f"import {a.name} (not a public module)"))
                elif a.asname:
                    bound[a.asname] = a.name
                else:
                    bound["shardwise"] = "shardwise"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardwise":
            if not _public_module(node.module):
                found.append((node.lineno, f"from {node.module} import ... (not a public module)"))
                continue
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if a.name not in _exports(node.module):
                    found.append((node.lineno, f"from {node.module} import {a.name} (not in its __all__)"))
                elif _public_module(sub):
                    bound[a.asname or a.name] = sub
    for node in ast.walk(tree):  # sw.a (a in sw.__all__) and sw.a.b where sw.a is a public module
        if not isinstance(node, ast.Attribute):
            continue
        base, text = node.value, ""
        if isinstance(base, ast.Name) and base.id in bound:
            module, text = bound[base.id], base.id
        elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) and base.value.id in bound and \
                _public_module(f"{bound[base.value.id]}.{base.attr}"):
            module, text = f"{bound[base.value.id]}.{base.attr}", f"{base.value.id}.{base.attr}"
        else:
            continue
        if node.attr not in _exports(module):
            found.append((node.lineno, f"{text}.{node.attr} ({node.attr!r} is not in {module}.__all__)"))
    return [f"{where}:{first_line + line - 1}: {what}" for line, what in sorted(set(found))]


def blocks() -> list[tuple[str, int, str]]:
    """(file, first line, code) of every ```python block of the docs, every import line elsewhere in them (the
    ``python -c "..."`` of a shell block) and every example file."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            out.append((str(doc.relative_to(ROOT)), text.count("\n", 0, m.start(1)) + 1, textwrap.dedent(m.group(1))))
        rest = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)  # same line numbers, python blocks out
        for n, line in enumerate(rest.splitlines(), 1):
            if IMPORT_LINE.match(line):
                out.append((str(doc.relative_to(ROOT)), n, line.strip()))
    out += [(str(p.relative_to(ROOT)), 1, p.read_text()) for p in EXAMPLES]
    return out


def test_docs_and_examples_use_only_the_public_api():
    found = blocks()
    assert len(found) >= 20, "the docs' python blocks were not found"
    bad = []
    for where, line, code in found:
        try:
            bad += violations(code, where, line)
        except SyntaxError as e:
            bad.append(f"{where}:{line + (e.lineno or 1) - 1}: not Python ({e.msg})")
    assert not bad, "the docs use names outside the public API (export them or use the public name):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("snippet, expected", [
    ("from shardwise.parallel.tensor.api import gpt_plan", "not a public module"),
    ("import shardwise.sbp.boxing", "not a public module"),
    ("from shardwise.comm import ring", "not in its __all__"),
    ("from shardwise import parallel", "not in its __all__"),
    ("import shardwise as sw\nsw.parallel.tensor.gpt_plan(cfg)", "'parallel' is not in shardwise.__all__"),
    ("import shardwise as sw\nx = 1\nsw.comm.ring.all_reduce(t)", "'ring' is not in shardwise.comm.__all__"),
    ("from shardwise import comm as c\nc.shm.open()", "'shm' is not in shardwise.comm.__all__"),
])
def test_the_check_catches_internal_names(snippet, expected):
    bad = violations(snippet, "snippet.md", 10)
    assert bad and expected in bad[0], bad
    assert bad[0].startswith(f"snippet.md:{10 + snippet.count(chr(10))}:"), bad  # names file and line


def test_import_lines_of_shell_blocks_are_checked_too():
    line = "from shardwise.parallel.common.activation_checkpointing import checkpoint_report"
    assert IMPORT_LINE.match(line) and violations(line, "x.md")
    assert not IMPORT_LINE.match("shardwise train --parallel.tp 2") and not IMPORT_LINE.match("import torch")


def test_the_check_passes_public_names():
    ok = ("import shardwise as sw\nfrom shardwise.models import GPT\nfrom shardwise.schedules import get_schedule\n"
          "import shardwise.planner as planner\nsw.comm.all_reduce(t)\nsw.planner.Layout(dp=2)\nplanner.search\n"
          "sw.gpt_plan(cfg)\nsw.Replicate()")
    assert violations(ok, "ok.md") == []


def _documented(obj: object) -> bool:
    if inspect.ismodule(obj) or inspect.isroutine(obj):
        return bool(inspect.getdoc(obj))
    if inspect.isclass(obj):
        doc = obj.__dict__.get("__doc__") or ""
        return bool(doc.strip()) and not doc.startswith(f"{obj.__name__}(")  # not the dataclass's signature
    return True  # constants (``__version__``, ``PRESETS``): documented where their module's docstring names them


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_name_exists_and_is_documented(module):
    mod = importlib.import_module(module)
    assert mod.__doc__ and mod.__doc__.strip(), f"{module} has no docstring"
    missing = [n for n in mod.__all__ if not hasattr(mod, n)]
    assert not missing, f"{module}.__all__ names what it lacks: {missing}"
    undocumented = [n for n in mod.__all__ if not _documented(getattr(mod, n))]
    assert not undocumented, f"{module}: these public names have no docstring: {undocumented}"
    assert len(mod.__all__) == len(set(mod.__all__)), f"{module}.__all__ repeats a name"


def _resolve(dotted: str) -> object:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("old, new", ALIASES)
def test_old_names_are_aliases_of_the_new(old, new):
    assert _resolve(old) is _resolve(new)
    module, _, name = new.rpartition(".")
    assert name in _exports(module) and old.rpartition(".")[2] in _exports(module)


def test_the_old_tensor_module_still_imports_but_warns():
    import sys
    sys.modules.pop("shardwise.parallel.tensor.api", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("shardwise.parallel.tensor.api")
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert old.gpt_plan is sw.gpt_plan and old.vocab_parallel_cross_entropy is sw.vocab_parallel_cross_entropy
