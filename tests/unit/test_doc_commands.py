"""Every ``shardwise ...`` line in a ``bash`` block of the README and the docs is a command the CLI accepts: its
own parser reads it (no unknown or abbreviated option, no missing argument), and for ``train``, ``verify``,
``predict`` and ``plan`` lines whose files exist in the repository, the config it names builds and validates
(layout and batch arithmetic) without launching anything. Lines that run end to end are in
tests/e2e/test_readme_commands.py and test_walkthrough.py."""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import pytest

from shardwise.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```bash\n(.*?)```", re.S)
CONFIG_COMMANDS = ("train", "verify", "predict", "plan")
PATH_FLAGS = ("--model.hf_config", "--model.pretrained", "--data.path", "--data.val_path", "--config", "--resume",
              "--hardware", "--parallel.calibration", "--model.hf_config=")


def doc_commands() -> list[tuple[str, str]]:
    """(where, command line) of each ``shardwise`` line of every bash block, continuations joined, comments cut."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for block in FENCE.finditer(text):
            joined = block.group(1).replace("\\\n", " ")
            first = text.count("\n", 0, block.start()) + 2
            for offset, line in enumerate(joined.splitlines()):
                for part in line.split(" #", 1)[0].split("&&"):  # a && b: two commands
                    part = re.sub(r"\$\(\([^)]*\)\)", "10", part.strip())  # shell arithmetic: a number
                    if part.startswith("shardwise "):
                        found.append((f"{doc.relative_to(ROOT)}:{first + offset}", part))
    return found


COMMANDS = doc_commands()


def test_the_docs_hold_commands():
    assert len(COMMANDS) > 50 and {line.split()[1] for _, line in COMMANDS} >= {"train", "verify", "plan", "predict",
                                                                               "prepare", "export", "generate"}


@pytest.mark.parametrize("where,line", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_the_cli_parses_every_documented_command(where: str, line: str, capsys: pytest.CaptureFixture[str]):
    argv = shlex.split(line.replace("$", ""))[1:]
    try:
        build_parser(argv).parse_args(argv)
    except SystemExit as exc:
        if exc.code:  # --help exits 0
            pytest.fail(f"{where}: `{line}` is refused: {capsys.readouterr().err.strip()[-400:]}")


def _local_paths_exist(argv: list[str]) -> bool:
    """Whether every file the line names exists here (docs name the user's own: gpt2-dir, data/web, run.toml)."""
    for flag, value in zip(argv, argv[1:]):
        if flag in PATH_FLAGS and not (ROOT / value).exists() and not flag == "--hardware":
            return False
        if flag == "--hardware" and value.endswith(".json") and not (ROOT / value).exists():
            return False
    return "--nnodes" not in argv  # a multi-node line needs its rendezvous


CONFIGURED = [(w, line) for w, line in COMMANDS if line.split()[1] in CONFIG_COMMANDS
              and _local_paths_exist(shlex.split(line)[1:]) and "$" not in line]


@pytest.mark.parametrize("where,line", CONFIGURED, ids=[w for w, _ in CONFIGURED])
def test_documented_layouts_validate(where: str, line: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    from shardwise.cli.train import config_overrides
    from shardwise.runtime.config import load_config, validate

    monkeypatch.chdir(ROOT)
    argv = shlex.split(line)[1:]
    args = build_parser(argv).parse_args(argv)
    if getattr(args, "resume", None) or getattr(args, "parallel_auto", None):
        pytest.skip("a resume reads its run; auto layouts are searched (tests/unit/test_plan_command.py)")
    overrides = config_overrides(args)
    if str(overrides.get("parallel.auto", "")).lower() == "true" or argv[0] == "plan":
        pytest.skip("searched, not given: the planner's own tests")
    cfg = load_config(path=getattr(args, "config", None), preset=getattr(args, "preset", None), overrides=overrides)
    if not cfg.parallel.nproc:  # every local GPU, or 2 CPU ranks: here, 2
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, nproc=2))
    try:
        validate(cfg, launch=False)
    except ValueError as exc:
        pytest.fail(f"{where}: `{line}` does not validate: {exc}")
