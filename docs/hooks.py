"""mkdocs hooks of the documentation site (``mkdocs.yml``: ``hooks:``); not a page (``exclude_docs``).

- ``reference/cli.md`` is replaced at build time by the Markdown ``shardwise.cli.reference`` generates from the
  argparse parsers, so the command-line reference cannot go stale (the file in the repository is a stub that
  says so, for readers of the repository and for its link checks).
- Links from a page in ``docs/`` to a file of the repository outside it (``../README.md``,
  ``../benchmarks/RESULTS.md``) are not pages of the site. mkdocs reports them as "not found among
  documentation files"; when the file exists in the repository that report is lowered to INFO, so
  ``mkdocs build --strict`` passes. A link to a repository file that does not exist, and every broken link or
  anchor between pages of ``docs/``, stays a warning (an error under ``--strict``).
- A reference page's ``::: module`` renders the names of the module's ``__all__``, except a function or class
  imported under the name of the submodule that defines it (``from .predict import predict``): griffe sees the
  submodule there (mkdocstrings/griffe#124) and does not render it. Such names get a ``:::`` directive of their
  own, on the path that defines them, added at the end of the page.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import types

CLI_PAGE = "reference/cli.md"  # its text in the repository is a stub; the site gets the generated page
_NOT_FOUND = re.compile(r"^Doc file '(?P<page>[^']+)' contains a link '(?P<link>\.\./[^'#?]*)[^']*', "
                        r"but the target (?:'[^']*' )?is not found among documentation files\.")


class _RepositoryLinks(logging.Filter):
    """Lowers mkdocs' "not found" warning to INFO for a link that leaves ``docs/`` to an existing file."""

    def __init__(self, docs_dir: str) -> None:
        super().__init__()
        self.docs_dir = docs_dir

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.WARNING:
            m = _NOT_FOUND.match(record.getMessage())
            if m:
                page_dir = os.path.dirname(os.path.join(self.docs_dir, m["page"]))
                target = os.path.normpath(os.path.join(page_dir, m["link"]))
                outside = os.path.relpath(target, self.docs_dir).startswith("..")
                if outside and os.path.exists(target):
                    record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def on_config(config):
    logger = logging.getLogger("mkdocs.structure.pages")
    for old in [f for f in logger.filters if isinstance(f, _RepositoryLinks)]:  # mkdocs serve rebuilds
        logger.removeFilter(old)
    logger.addFilter(_RepositoryLinks(config["docs_dir"]))
    return config


_DIRECTIVE = re.compile(r"^::: (?P<path>[\w.]+)[ \t]*$", re.M)


def shadowed(module_name: str) -> list[str]:
    """The defining paths of the functions and classes in ``module_name.__all__`` that griffe takes for a
    submodule: those whose defining module's package exports them under that module's own name."""
    try:
        mod = importlib.import_module(module_name)
    except ImportError:  # a ::: directive on a class or function, not a module
        return []
    out = []
    for name in getattr(mod, "__all__", ()):
        obj = getattr(mod, name, None)
        qualname, defining = getattr(obj, "__qualname__", None), getattr(obj, "__module__", None)
        if isinstance(obj, types.ModuleType) or not isinstance(qualname, str) or not isinstance(defining, str):
            continue
        package, _, last = defining.rpartition(".")
        if last == qualname and getattr(sys.modules.get(package), last, None) is obj:
            out.append(f"{defining}.{qualname}")
    return out


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri == CLI_PAGE:
        from shardwise.cli.reference import markdown as cli_markdown

        return cli_markdown()
    if page.file.src_uri.startswith("reference/"):
        for m in list(_DIRECTIVE.finditer(markdown)):
            for path in shadowed(m["path"]):
                markdown += f"\n\n::: {path}\n    options:\n      show_root_full_path: false\n"
    return markdown
