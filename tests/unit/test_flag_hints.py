"""Command-line hygiene: options are never abbreviated, an unknown option names the one meant (other tools'
spellings, a field of that name, a close spelling), and hardware preset names match in any case."""

from __future__ import annotations

import pytest

from shardwise.cli.flag_hints import ALIASES, suggest
from shardwise.cli.main import main
from shardwise.planner import PRESETS, Hardware


def _train_options() -> list[str]:
    from shardwise.cli.main import build_parser

    parser = build_parser(["train"])
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return list(sub.choices["train"]._option_string_actions)


@pytest.mark.parametrize("given,meant", [
    ("--steps", "--train.steps"), ("--lr", "--optimizer.lr"), ("--batch-size", "--data.global_batch"),
    ("--batch_size", "--data.global_batch"), ("--micro-batch", "--parallel.micro_batch"),
    ("--micro_batch", "--parallel.micro_batch"), ("--nproc", "--parallel.nproc"), ("--tp", "--parallel.tp"),
    ("--pp", "--parallel.pp"), ("--dp", "--parallel.dp"), ("--cp", "--parallel.cp"),
    ("--zero", "--parallel.zero_stage"), ("--seed", "--train.seed"), ("--name", "--train.name"),
    ("--resume-from", "--resume"), ("--restore", "--resume"), ("-n", "--parallel.nproc"),
    ("--parallel.zero", "--parallel.zero_stage"), ("--paralel.tp", "--parallel.tp"), ("--trian.steps", "--train.steps"),
    ("--block-size", "--model.block_size"), ("--bf16", "--train.precision bf16"), ("--over", "--overwrite"),
])
def test_unknown_train_options_name_the_one_meant(given, meant):
    assert suggest(given, _train_options()) == meant


def test_suggestions_are_options_the_command_has():
    options = _train_options()
    for alias, target in ALIASES.items():
        hint = suggest("--" + alias, options)
        assert not hint or hint.split()[0] in options, (alias, hint)
    assert suggest("--xyzzy", options) == ""
    assert suggest("--lr", ["--steps", "--rtol"]) == ""  # a command without --optimizer.lr gets no alias


@pytest.mark.parametrize("argv,expected", [
    (["train", "--parallel.zero", "3"], "unknown option --parallel.zero (options are not abbreviated); did you mean "
                                        "--parallel.zero_stage?"),
    (["train", "--train.step", "3"], "did you mean --train.steps?"),  # a prefix of a real option: refused
    (["train", "--steps", "3"], "unknown option --steps; did you mean --train.steps?"),
    (["verify", "--step", "3"], "did you mean --steps?"),
])
def test_abbreviations_are_refused_in_one_line(argv, expected, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and "\n" not in err and expected in err, err


@pytest.mark.parametrize("name", ["h100-80g-sxm", "H100-80G-SXM", " a100-80g-sxm", "H200-141g-SXM"])
def test_hardware_names_match_in_any_case(name):
    hw = Hardware.resolve(name)
    assert hw == PRESETS[name.strip().lower()]


@pytest.mark.parametrize("name,meant", [("h100", ["h100-80g-sxm"]), ("A100", ["a100-80g-sxm"]),
                                        ("a100-80g", ["a100-80g-sxm"]), ("h200-141g", ["h200-141g-sxm"])])
def test_unknown_hardware_suggests_the_presets_it_names(name, meant):
    with pytest.raises(ValueError) as exc:
        Hardware.resolve(name)
    text = str(exc.value)
    assert f"unknown hardware {name!r}" in text and "\n" not in text
    assert "did you mean " + " or ".join(repr(m) for m in meant) + "?" in text
    assert all(f"'{k}'" in text for k in PRESETS)  # every preset is listed
