"""The command table of ``shardwise.cli.main``: explicit lazy loaders, and what a missing module means."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

cli_main = importlib.import_module("shardwise.cli.main")  # the module (``shardwise.cli.main`` is also a function)


def test_every_loader_returns_a_command_module():
    for name, (load, _help) in {**cli_main.COMMANDS, **cli_main.BENCHES}.items():
        mod = load()
        assert callable(mod.add_arguments) and callable(mod.main), name


def _absent() -> object:
    from shardwise.bench import not_in_this_build  # type: ignore[attr-defined]  # noqa: F401
    raise AssertionError("unreachable")


def _broken_dependency() -> object:
    import shardwise_missing_third_party_dependency  # type: ignore[import-not-found]  # noqa: F401
    raise AssertionError("unreachable")


def test_a_command_absent_from_the_build_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]):
    monkeypatch.setitem(cli_main.BENCHES, "ghost", (_absent, "not shipped"))
    assert cli_main.main(["bench", "ghost"]) == 2
    assert capsys.readouterr().err == "shardwise: 'ghost' is not available in this build\n"


def test_a_missing_dependency_of_a_command_is_not_hidden(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(cli_main.COMMANDS, "broken", (_broken_dependency, "needs a package"))
    with pytest.raises(ModuleNotFoundError, match="shardwise_missing_third_party_dependency"):
        cli_main.main(["broken"])


def test_top_level_help_loads_no_command_module():
    code = ("import sys; from shardwise.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith(('shardwise.cli.', 'shardwise.bench'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "['shardwise.cli.main']"
