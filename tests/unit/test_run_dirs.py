"""Run names and what a resume says about itself (``cli/train.py``, ``cli/train_resume.py``): pure functions, no
process started. The end-to-end checks (locks against real launches, resuming a pretrained run whose directory
is gone) are in ``tests/e2e/test_run_dirs.py``."""

from __future__ import annotations

import argparse
import dataclasses
import math
from pathlib import Path

import pytest

from shardwise.runtime.config import Config, OptimizerConfig, TrainConfig
from shardwise.runtime.config_schema import ModelConfig
from shardwise.runtime.model_build import model_run_name

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "examples" / "hf" / "tiny-llama.json"


def _args(module: str, *argv: str) -> argparse.Namespace:
    import importlib

    parser = argparse.ArgumentParser()
    importlib.import_module(f"shardwise.cli.{module}").add_arguments(parser)
    return parser.parse_args(list(argv))


def test_models_from_files_name_their_runs():
    assert model_run_name(ModelConfig(pretrained="/data/models/SmolLM-135M")) == "SmolLM-135M"
    assert model_run_name(ModelConfig(hf_config="/x/tiny-llama.json")) == "tiny-llama"
    assert model_run_name(ModelConfig(hf_config="/x/Llama-3.2-1B/config.json")) == "Llama-3.2-1B"  # HF's file name
    assert model_run_name(ModelConfig()) == ""  # the GPT: its preset names it


def test_train_names_a_run_after_its_hf_config_unless_named(tmp_path):
    from shardwise.cli.train import config_overrides, train_config

    def name(*argv: str) -> str:
        args = _args("train", *argv)
        return train_config(args, config_overrides(args)).train.name

    assert name() == "gpt-tiny"
    assert name("--preset", "gpt-small") == "gpt-small"
    assert name("--model.hf_config", str(LLAMA)) == "tiny-llama"
    assert name("--model.hf_config", str(LLAMA), "--preset", "gpt-tiny") == "tiny-llama"  # a preset names its GPT
    assert name("--model.hf_config", str(LLAMA), "--train.name", "mine") == "mine"
    named = tmp_path / "run.toml"
    named.write_text(f'[model]\nhf_config = "{LLAMA}"\n[train]\nname = "from-toml"\n')
    assert name("--config", str(named)) == "from-toml"
    unnamed = tmp_path / "unnamed.toml"
    unnamed.write_text(f'[model]\nhf_config = "{LLAMA}"\n[train]\nsteps = 5\n')
    assert name("--config", str(unnamed)) == "tiny-llama"


def test_verify_scratch_runs_live_beside_the_run_never_inside_it():
    from shardwise.cli.verify import _configs

    reference, layout, root = _configs(_args("verify", "--parallel.nproc", "2"))
    assert root == Path("runs") / "verify-gpt-tiny"
    for cfg in (reference, layout):
        assert Path(cfg.train.out_dir).parent == root
        assert Path("runs/gpt-tiny") not in Path(cfg.train.out_dir).parents
    _, _, root = _configs(_args("verify", "--parallel.nproc", "2", "--model.hf_config", str(LLAMA)))
    assert root == Path("runs") / "verify-tiny-llama"


def _cosine(step: int, lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The schedule as the docs state it: linear warm-up, then cosine from lr to min_lr over the rest."""
    if step <= warmup:
        return lr * step / warmup
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup)))) / 2


def test_a_resume_with_other_steps_states_the_new_schedule():
    from shardwise.cli.train_resume import schedule_note

    o = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=50)
    before = Config(optimizer=o, train=TrainConfig(steps=1000))
    after = Config(optimizer=o, train=TrainConfig(steps=1500))
    note = schedule_note(before, after, 1000)
    assert "\n" not in note and "train.steps 1000 → 1500" in note and "at step 1500 (was 1000)" in note
    assert f"{_cosine(1001, 3e-3, 3e-4, 50, 1500):.3g}" in note  # 1.07e-03: up from min_lr
    assert f"{_cosine(1001, 3e-3, 3e-4, 50, 1000):.3g}" in note  # the saved schedule had reached min_lr
    assert schedule_note(before, before, 1000) == ""
    constant = dataclasses.replace(o, schedule="constant")
    assert schedule_note(dataclasses.replace(before, optimizer=constant),
                         dataclasses.replace(after, optimizer=constant), 1000) == ""


def test_a_warmup_longer_than_the_run_is_a_warning():
    from shardwise.cli.train import _warmup_warning

    cfg = Config(optimizer=OptimizerConfig(lr=3e-3, warmup_steps=50), train=TrainConfig(steps=30))
    line = _warmup_warning(cfg)
    assert "warning:" in line and "optimizer.warmup_steps = 50 >= train.steps = 30" in line
    assert f"{3e-3 * 30 / 50:.3g}" in line and "--optimizer.warmup_steps 3" in line
    assert _warmup_warning(dataclasses.replace(cfg, train=TrainConfig(steps=51))) == ""
    assert _warmup_warning(dataclasses.replace(cfg, optimizer=OptimizerConfig(warmup_steps=0))) == ""


@pytest.mark.parametrize("saved_tp,flags,fixes", [
    (2, ["--parallel.pp", "2"], ["--parallel.tp 1 (dp 1 × tp 1 × pp 2 × cp 1, ZeRO-0 on 2 processes)",
                                 "--parallel.nproc 4 (dp 1 × tp 2 × pp 2 × cp 1, ZeRO-0 on 4 processes)"]),
    (2, ["--parallel.pp", "2", "--parallel.tp", "2"], ["--parallel.nproc 4"]),
])
def test_a_kept_layout_that_no_longer_fits_is_refused_with_both_layouts(saved_tp, flags, fixes):
    from shardwise.cli.train import config_overrides
    from shardwise.cli.train_resume import check_layout_fits, relayout
    from shardwise.runtime.config import ParallelConfig, load_config

    saved = ParallelConfig(nproc=2, dp=1, tp=saved_tp)
    overrides = config_overrides(_args("train", *flags))
    new = relayout(saved, load_config(base=Config(parallel=saved), overrides=overrides).parallel, overrides)
    new = dataclasses.replace(new, nproc=2)
    with pytest.raises(ValueError) as err:
        check_layout_fits(saved, new, overrides, Path("runs/t/checkpoints/step_000010"))
    line = str(err.value)
    assert "the saved layout is dp 1 × tp 2 × pp 1 × cp 1, ZeRO-0 on 2 processes" in line
    assert "= 4 processes per replica" in line and "parallel.nproc = 2" in line and "= 0" not in line
    for fix in fixes:
        assert fix in line, (fix, line)
    assert ("kept from the saved run: tp 2" in line) == ("--parallel.tp" not in flags)
