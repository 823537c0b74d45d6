"""The documentation site builds with ``mkdocs build --strict`` (any warning is an error: a broken link or
anchor between pages, a page missing from the nav, a docstring griffe cannot match to its signature), and its
API reference shows every name of every public module's ``__all__`` on that module's page.

The site: ``mkdocs.yml``, ``docs/``, the reference pages ``docs/reference/``, the command-line page generated
from the argparse parsers by ``docs/hooks.py``. Needs the ``docs`` extra (in ``dev``); skipped without mkdocs.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120

# public module -> its reference page (docs/reference/<page>.md, built as reference/<page>/index.html)
PAGES = {
    "shardwise": "shardwise",
    "shardwise.models": "models",
    "shardwise.comm": "comm",
    "shardwise.planner": "planner",
    "shardwise.schedules": "schedules",
}

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None,
    reason="mkdocs and mkdocstrings-python are not installed (pip install -e '.[docs]')")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config),
                           "--site-dir", str(site)], cwd=config.parent, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def _warnings(proc: subprocess.CompletedProcess) -> str:
    return "\n".join(line for line in (proc.stdout + proc.stderr).splitlines() if not line.startswith("INFO"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    proc = _build(ROOT / "mkdocs.yml", site)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{_warnings(proc)}"
    return site


def _page(site: Path, module: str) -> str:
    return (site / "reference" / PAGES[module] / "index.html").read_text()


def _ids(obj: object, module: str, name: str) -> list[str]:
    """The heading ids the name may have on its page: ``module.name``, or, for a function or class griffe sees
    under another path (an import that a submodule of the same name shadows, e.g. ``planner.predict``, which
    ``docs/hooks.py`` renders from where it is defined), its defining path."""
    ids = [f"{module}.{name}"]
    qualname = getattr(obj, "__qualname__", None)
    if isinstance(qualname, str) and getattr(obj, "__module__", None):
        ids.append(f"{obj.__module__}.{qualname}")
    return ids


@needs_mkdocs
def test_public_modules_have_pages():
    """Every public module named in a public module's ``__all__`` that is a package of its own (``sw.comm``,
    ``sw.models``, ``sw.planner``) has a page; the pages listed here exist."""
    for module, page in PAGES.items():
        assert (ROOT / "docs" / "reference" / f"{page}.md").is_file(), f"docs/reference/{page}.md is missing"
        mod = importlib.import_module(module)
        for name in mod.__all__:
            obj = getattr(mod, name)
            if isinstance(obj, types.ModuleType) and obj.__name__.count(".") == 1:
                assert obj.__name__ in PAGES, f"{module}.{name} is a public module without a reference page"


@needs_mkdocs
@pytest.mark.parametrize("module", list(PAGES))
def test_every_public_name_is_on_its_page(site, module):
    html = _page(site, module)
    mod = importlib.import_module(module)
    missing = []
    for name in mod.__all__:
        obj = getattr(mod, name)
        if isinstance(obj, types.ModuleType) and obj.__name__ in PAGES:
            # a module with a page of its own: linked from this one, its heading there
            own = PAGES[obj.__name__]
            if f'href="../{own}/"' not in html or f'id="{obj.__name__}"' not in _page(site, obj.__name__):
                missing.append(f"{name} (a link to reference/{own}.md)")
        elif not any(f'id="{i}"' in html for i in _ids(obj, module, name)):
            missing.append(name)
    assert not missing, (
        f"reference/{PAGES[module]}.md does not show {missing} of {module}.__all__: a name without a docstring "
        "is not rendered (give it one), a public submodule needs its own ':::' directive")
    shown = set(re.findall(rf'id="{re.escape(module)}\.([^".]+)"', html))
    extra = shown - set(mod.__all__)
    assert not extra, f"reference/{PAGES[module]}.md shows {sorted(extra)}, which {module}.__all__ does not list"


@needs_mkdocs
def test_cli_page_has_every_command(site):
    from shardwise.cli.main import BENCHES, COMMANDS

    html = (site / "reference" / "cli" / "index.html").read_text()
    for name in COMMANDS:
        assert f'id="shardwise-{name}"' in html, name
    for name in BENCHES:
        assert f'id="shardwise-bench-{name}"' in html, name
    assert "usage: shardwise train" in html


@needs_mkdocs
def test_strict_build_fails_on_broken_links(tmp_path):
    """The check can fail: the same site with a link to a heading that does not exist, or to a repository file
    outside ``docs/`` that does not exist, does not build (an existing one, ``../README.md``, is fine)."""
    work = tmp_path / "repo"
    work.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", work / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", work / "docs")
    for outside in ("shardwise", "README.md", "benchmarks"):  # the code, and files pages link to outside docs/
        (work / outside).symlink_to(ROOT / outside)
    index = work / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [training](training.md#no-such-heading-anywhere), "
                     "[the README](../README.md) and [nothing](../NO_SUCH_FILE.md).\n")
    proc = _build(work / "mkdocs.yml", tmp_path / "site")
    warnings = _warnings(proc)
    assert proc.returncode != 0
    assert "does not contain an anchor '#no-such-heading-anywhere'" in warnings, warnings
    assert "contains a link '../NO_SUCH_FILE.md'" in warnings, warnings
    assert "'../README.md'" not in warnings, warnings
