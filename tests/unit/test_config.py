"""The config tree: defaults, presets, TOML, dotted overrides, validation messages; LR schedule; loss comparison."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from shardwise.runtime.config import (Config, DataConfig, ModelConfig, ParallelConfig, apply_overrides, describe_fields,
                                      load_config, parse_overrides, validate)


def test_every_field_is_documented_and_frozen_keyword_only():
    for key, _default, doc in describe_fields():
        assert doc, f"{key} has no docstring"
    for section in dataclasses.fields(Config):
        cls = typing.get_type_hints(Config)[section.name]
        params = cls.__dataclass_params__
        assert params.frozen and cls.__dataclass_fields__  # frozen
        with pytest.raises(TypeError):
            cls(1)  # keyword-only
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().train.steps = 3  # type: ignore[misc]


def test_precedence_defaults_preset_toml_flags(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('preset = "gpt-small"\n[model]\nn_layer = 3\n[train]\nsteps = 50\nname = "mine"\n')
    cfg = load_config(path=toml, overrides={"train.steps": "7", "parallel.algorithm": "ring"})
    assert cfg.model.n_embd == 256  # from the preset
    assert cfg.model.n_layer == 3  # TOML beats the preset
    assert cfg.train.steps == 7  # flags beat TOML
    assert cfg.parallel.algorithm == "ring"
    assert cfg.run_dir().as_posix() == "runs/mine"
    assert load_config().run_dir().as_posix() == "runs/gpt-tiny"


def test_parse_overrides_both_spellings():
    assert parse_overrides(["--parallel.tp", "2", "--train.steps=5"]) == {"parallel.tp": "2", "train.steps": "5"}
    with pytest.raises(ValueError, match="--parallel.tp needs a value"):
        parse_overrides(["--parallel.tp"])
    with pytest.raises(ValueError, match="overrides look like --section.field VALUE"):
        parse_overrides(["tp=2"])


@pytest.mark.parametrize("key,value,message", [
    ("parallel.tp", "x", "parallel.tp must be a int, got 'x'"),
    ("model.bias", "maybe", "model.bias must be a bool"),
    ("optimizer.lr", "fast", "optimizer.lr must be a float"),
    ("parallel.algorithm", "butterfly", "choose one of ['native', 'ring', 'tree', 'shm', 'auto']"),
    ("parallel.tpp", "2", "did you mean 'tp'"),
    ("paralel.tp", "2", "unknown config key 'paralel.tp'"),
])
def test_override_errors_name_the_field_and_the_fix(key, value, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")):
        apply_overrides(Config(), {key: value})


def test_overrides_convert_types():
    cfg = apply_overrides(Config(), {"model.bias": "false", "optimizer.lr": "1e-2", "parallel.tp": "2"})
    assert cfg.model.bias is False and cfg.optimizer.lr == 0.01 and cfg.parallel.tp == 2


def _cfg(**parallel) -> Config:
    return Config(parallel=ParallelConfig(**{"nproc": 4, **parallel}), data=DataConfig(global_batch=16),
                  model=ModelConfig(n_head=4))


@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_zero_composes_with_tensor_parallelism(zero_stage):
    p = validate(_cfg(micro_batch=2, tp=2, zero_stage=zero_stage)).parallel  # ZeRO over dp 2, tp 2 inside
    assert (p.nproc, p.dp, p.tp, p.zero_stage) == (4, 2, 2, zero_stage)


def test_validate_resolves_dp_and_grad_accum():
    p = validate(_cfg(micro_batch=2, tp=2)).parallel
    assert (p.nproc, p.dp, p.tp, p.grad_accum) == (4, 2, 2, 4)  # 16 = 2 × 4 × 2
    p = validate(_cfg(micro_batch=4)).parallel
    assert (p.dp, p.grad_accum) == (4, 1)


@pytest.mark.parametrize("parallel,message", [
    ({"tp": 3}, "parallel.tp = 3 must divide model.n_head = 4"),
    ({"dp": 3}, "parallel.dp × parallel.tp × parallel.pp = 3 × 1 × 1 = 3 must equal the number of processes"),
    ({"micro_batch": 3}, "global_batch=16 is not a multiple of micro_batch × dp = 3 × 4 = 12"),
    ({"micro_batch": 2, "grad_accum": 3}, "micro_batch × parallel.grad_accum × dp = 2 × 3 × 4 = 24; set --data.global_batch 24, or --parallel.grad_accum 2"),
    ({"zero_stage": 5}, "parallel.zero_stage = 5 must be 0, 1, 2 or 3"),
    ({"pp": 3}, "parallel.pp = 3 processes per replica do not divide parallel.nproc = 4 (parallel.dp is inferred "
                "as nproc / that); set --parallel.nproc 3 or 6 or lower pp"),
    ({"pp": 2, "tp": 4}, "parallel.tp × parallel.pp = 4 × 2 = 8 processes per replica do not divide parallel.nproc = 4"),
    ({"pp": 2, "zero_stage": 3, "offload": "params"}, "parallel.offload = params"),
    ({"pp": 2, "algorithm": "ring"}, "parallel.algorithm = 'ring' with parallel.pp = 2 is not supported"),
    ({"pp": 2, "micro_batch": 4, "pp_schedule": "1f2b"}, "unknown parallel.pp_schedule '1f2b'; did you mean '1f1b'? "
                                                        "valid: 1f1b, gpipe, interleaved, zb-h1"),
    ({"pp": 2, "micro_batch": 4, "pp_microbatches": 3}, "parallel.micro_batch = 4 must be divisible by "
                                                        "parallel.pp_microbatches = 3"),
    ({"pp": 2, "micro_batch": 4, "pp_schedule": "interleaved"}, "schedule 'interleaved' needs chunks >= 2"),
    ({"pp": 2, "micro_batch": 4, "pp_schedule": "interleaved", "pp_chunks": 2, "pp_microbatches": 1},
     "needs the micro-batch count to be a multiple of p"),
    ({"pp": 4, "micro_batch": 2, "pp_schedule": "interleaved", "pp_chunks": 2}, "parallel.micro_batch = 2 cannot "
                                                                               "be cut into 4 equal parts"),
    ({"pp": 4, "micro_batch": 4, "pp_schedule": "interleaved", "pp_chunks": 2},
     "the model has 4 pipeline units (['wte', 'blocks.0', 'blocks.1', 'ln_f']) but pp x chunks = 8 stages"),
    ({"pp": 2, "micro_batch": 4, "pp_split": ("lm_head",)}, "'lm_head' is inside unit 'ln_f', which cannot be cut"),
    ({"pp": 2, "micro_batch": 4, "pp_split": ("blocks.1", "ln_f")}, "makes 3 stages but the mesh axis and chunks "
                                                                   "need pp x chunks = 2"),
    ({"micro_batch": 4, "pp_chunks": 2}, "parallel.pp_chunks = 2 only applies to pipeline parallelism, but "
                                         "parallel.pp = 1"),
    ({"micro_batch": 4, "pp_split": ("blocks.1",)}, "parallel.pp_split = ('blocks.1',) only applies to pipeline"),
])
def test_validation_messages(parallel, message):
    with pytest.raises(ValueError) as info:
        validate(_cfg(**parallel))
    assert message in str(info.value)


def test_validate_resolves_the_pipeline_layout():
    # pp × dp = 2 × 2; each pass is micro_batch × dp = 8 sequences, 4 per replica cut into pipeline micro-batches
    p = validate(_cfg(pp=2, micro_batch=4)).parallel
    assert (p.dp, p.grad_accum, p.pp_microbatches) == (2, 2, 4)  # 16 = 4 × 2 × 2; largest divisor of 4 <= 2·pp
    p = validate(_cfg(pp=2, micro_batch=8)).parallel
    assert (p.dp, p.grad_accum, p.pp_microbatches) == (2, 1, 4)
    p = validate(_cfg(pp=2, micro_batch=8, pp_microbatches=8, pp_schedule="gpipe", pp_split=("blocks.0",))).parallel
    assert (p.pp_microbatches, p.pp_split) == (8, ("blocks.0",))
    interleaved = Config(parallel=ParallelConfig(nproc=4, pp=4, micro_batch=12, pp_schedule="interleaved", pp_chunks=2),
                         data=DataConfig(global_batch=12), model=ModelConfig(n_head=4, n_layer=6))
    assert validate(interleaved).parallel.pp_microbatches == 4  # <= 2·pp = 8, divides 12, multiple of pp = 4
    assert validate(_cfg(micro_batch=4)).parallel.pp_microbatches == 0  # no pipeline


@pytest.mark.parametrize("parallel", [
    {"pp": 2, "tp": 2, "micro_batch": 4},                                   # tp inside the stages (dp 1)
    {"pp": 2, "zero_stage": 1, "micro_batch": 4},                           # ZeRO-1 over dp 2, grad_accum 2
    {"pp": 2, "activation_checkpointing": True, "micro_batch": 4},
    {"pp": 2, "tp": 2, "activation_checkpointing": True, "micro_batch": 4},
    {"pp": 2, "tp": 2, "zero_stage": 1, "micro_batch": 4},                  # ZeRO-1 with tp inside the stages
], ids=["pp-tp", "pp-zero1", "pp-ckpt", "pp-tp-ckpt", "pp-tp-zero1"])
def test_pipeline_hybrids_are_valid_layouts(parallel):
    p = validate(_cfg(**parallel)).parallel
    assert p.dp * p.tp * p.pp == p.nproc == 4 and p.pp_microbatches >= 1


def test_pp_split_from_a_flag_or_a_toml_list(tmp_path):
    assert apply_overrides(Config(), {"parallel.pp_split": "blocks.2, ln_f"}).parallel.pp_split == ("blocks.2", "ln_f")
    toml = tmp_path / "run.toml"
    toml.write_text('[parallel]\npp = 2\npp_split = ["blocks.1"]\n')
    assert load_config(path=toml).parallel.pp_split == ("blocks.1",)
    with pytest.raises(ValueError, match="parallel.pp_split must be a list of names, got 3"):
        apply_overrides(Config(), {"parallel.pp_split": 3})
    saved = tmp_path / "config.json"  # the run's saved config round-trips (a JSON list)
    import json
    saved.write_text(json.dumps(load_config(path=toml).to_dict()))
    assert load_config(path=saved).parallel.pp_split == ("blocks.1",)


def test_resume_relayout_infers_sizes_again_and_drops_a_stale_split():
    from shardwise.cli.train_resume import relayout as _relayout

    saved = ParallelConfig(nproc=2, dp=1, pp=2, grad_accum=2, pp_microbatches=4, pp_split=("blocks.1",))
    to_one = _relayout(saved, dataclasses.replace(saved, pp=1, nproc=1), {"parallel.pp": "1", "parallel.nproc": "1"})
    assert (to_one.pp, to_one.nproc, to_one.dp, to_one.grad_accum, to_one.pp_microbatches, to_one.pp_split,
            to_one.pp_chunks) == (1, 1, 0, 0, 0, (), 1)
    same = _relayout(saved, saved, {})
    assert (same.pp, same.pp_split, same.pp_microbatches, same.nproc) == (2, ("blocks.1",), 0, 0)
    interleaved = dataclasses.replace(saved, pp_chunks=2, pp_schedule="interleaved")
    assert _relayout(interleaved, dataclasses.replace(interleaved, pp=1), {}).pp_chunks == 1


def test_lr_schedule_warmup_then_cosine():
    from shardwise.runtime.config import OptimizerConfig
    from shardwise.runtime.trainer import lr_at

    o = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(5, o, 110) == pytest.approx(0.5)
    assert lr_at(10, o, 110) == pytest.approx(1.0)
    assert lr_at(60, o, 110) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, o, 110) == pytest.approx(0.1)
    assert lr_at(50, dataclasses.replace(o, schedule="constant"), 110) == 1.0


def test_compare_losses_tolerance():
    from shardwise.cli.verify import compare_losses

    assert compare_losses([5.0, 4.0], [5.0 + 4e-4, 4.1], rtol=1e-4, atol=1e-5) == [True, False]


def test_step_batches_see_the_same_samples_under_any_dp_and_resume_position():
    """Step k of every layout covers the same windows; the saved position is layout-free."""
    import torch

    from shardwise.data.corpus import StepBatches
    from shardwise.data.windows import ShardedSampler, TokenWindows

    tokens = torch.arange(4 * 101 + 1, dtype=torch.int64) % 256
    ds = TokenWindows(tokens, 4)  # 101 windows; global batch 8 → 12 steps per epoch for every dp

    def streams(dp: int, accum: int) -> list[StepBatches]:
        return [StepBatches(ds, ShardedSampler(len(ds), dp_size=dp, dp_rank=r, seed=3), micro_batch=8 // dp // accum,
                            grad_accum=accum, device=torch.device("cpu")) for r in range(dp)]

    one, two = streams(1, 2), streams(2, 1)
    for _ in range(15):  # crosses an epoch boundary
        a = sorted(map(tuple, torch.cat([x for x, _ in one[0].next()]).tolist()))
        b = sorted(map(tuple, torch.cat([x for s in two for x, _ in s.next()]).tolist()))
        assert a == b
    assert one[0].state_dict() == two[0].state_dict() == {"epoch": 1, "global_offset": 24}
    resumed = streams(2, 1)
    for s in resumed:
        s.load_state_dict(one[0].state_dict())
    assert torch.equal(resumed[1].next()[0][0], two[1].next()[0][0])


def test_shm_algorithm_is_for_cpu_ranks(monkeypatch):
    import shardwise.runtime.config as config_module

    monkeypatch.setattr(config_module, "_cuda_available", lambda: False)
    assert validate(_cfg(micro_batch=4, algorithm="shm")).parallel.algorithm == "shm"
    monkeypatch.setattr(config_module, "_cuda_available", lambda: True)
    with pytest.raises(ValueError, match=r"parallel.algorithm = 'shm' moves host memory .* use --parallel.algorithm "
                                         r"auto"):
        validate(_cfg(micro_batch=4, algorithm="shm"))
    # nothing is launched (predict/plan): no device to check
    assert validate(_cfg(micro_batch=4, algorithm="shm"), launch=False).parallel.algorithm == "shm"
