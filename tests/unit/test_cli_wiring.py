"""The command table of ``shardwise.cli.main``: explicit lazy loaders, and what a missing module means."""

from __future__ import annotations

import importlib
import os
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


def test_exit_process_flushes_buffered_output_and_keeps_the_exit_code(tmp_path):
    """Entry points end with ``world.exit_process`` (``os._exit``): what was printed to a pipe (block-buffered,
    not yet flushed) still arrives, and the code is the process's exit status."""
    code = ("import sys\n"
            "from shardwise.world import exit_process\n"
            "print('summary line', end='')\n"  # no newline, stdout is a pipe: still in Python's buffer
            "print('to stderr', file=sys.stderr, end='')\n"
            "exit_process(int(sys.argv[1]))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # keep Python's own buffering
    for status in (0, 3):
        out = subprocess.run([sys.executable, "-c", code, str(status)], capture_output=True, text=True, timeout=120,
                             env=env)
        assert (out.returncode, out.stdout, out.stderr) == (status, "summary line", "to stderr")


def test_the_console_script_and_python_m_exit_with_main_s_code(tmp_path):
    """``python -m shardwise.cli`` goes through ``cli.entry``: a rejected config exits 2, as ``main`` returns."""
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--parallel.tp", "3"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert "parallel.tp" in out.stderr
