"""The package's shape, enforced (pure ``ast``, no imports of the code under test):

* imports point one way — mesh/world ← comm ← sbp ← parallel ← checkpoint, models ← planner, data ← runtime ←
  bench, testing ← cli — with no exception; two packages of one layer do not import each other;
* no import cycles between modules (lazy imports inside functions count too: a cycle is a design knot
  even when Python tolerates it);
* every file under 400 lines and every function under 60 (ARCHITECTURE.md, "Style").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "shardwise"

LAYERS: dict[str, int] = {
    "mesh": 0, "world": 0, "allocator": -1, "comm": 1, "sbp": 2, "parallel": 3, "checkpoint": 4, "models": 4, "schedules": 4,
    "planner": 5, "data": 5,
    "runtime": 6, "bench": 7, "testing": 7, "cli": 8,
}
"""Top-level module or package → layer. A new top-level package must be placed here deliberately."""

FACADE = "shardwise"  # ``shardwise/__init__.py`` re-exports the public API from every layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """Every shardwise module ``path`` imports (at any depth of the file), with the line number. ``from X import
    y`` counts as importing ``X.y`` when that is a module, else ``X``."""
    mod = module_name(path)
    package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "shardwise"]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "shardwise":
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            plain = len(subs) < len(node.names)
            found += [(s, node.lineno) for s in subs] + ([(target, node.lineno)] if plain else [])
    return found


def top_level(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else FACADE


def test_every_top_level_module_has_a_layer():
    tops = {top_level(m) for m in MODULES} - {FACADE}
    assert tops <= set(LAYERS), f"place these in LAYERS (tests/unit/test_layering.py): {sorted(tops - set(LAYERS))}"


def facade_layer() -> int:
    """The public API facade sits just above the highest layer it re-exports from: users' code, the benchmarks
    and the commands may ``import shardwise as sw``; the library below it may not."""
    return max(LAYERS[top_level(t)] for t, _ in imported_modules(MODULES[FACADE]) if top_level(t) != FACADE)


def test_imports_point_down_the_layers():
    wrong = []
    layer = {**LAYERS, FACADE: facade_layer()}
    for mod, path in MODULES.items():
        src = top_level(mod)
        if src == FACADE:
            continue
        for target, line in imported_modules(path):
            dst = top_level(target)
            if dst == src:
                continue
            if layer[dst] >= layer[src]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({src}, layer {layer[src]}) imports "
                             f"{target} ({dst}, layer {layer[dst]})")
    assert not wrong, "imports against the layers:\n" + "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    graph = {m: {t for t, _ in imported_modules(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    # the facade imports everything and nothing imports it back (checked above), so it cannot close a cycle
    assert _cycles(graph) == []


@pytest.mark.parametrize("path", sorted(MODULES.values()), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_file_and_function_size(path: Path):
    lines = path.read_text().splitlines()
    assert len(lines) < 400, f"{path.relative_to(PACKAGE.parent)} has {len(lines)} lines; split it (limit 400)"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
            for node in ast.walk(ast.parse("\n".join(lines)))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 >= 60]
    assert not long, f"{path.relative_to(PACKAGE.parent)}: functions of 60 lines or more: {long}"
