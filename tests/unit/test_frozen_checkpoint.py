"""``train.save_frozen = false``: the config check, the pieces it drops, and the resume guard (no ranks)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from shardwise.checkpoint.frozen import FROZEN_STATE, drop_frozen, frozen_keys
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.runtime.config import apply_overrides
from shardwise.runtime.config_ranges import check_numbers
from shardwise.runtime.config_schema import Config
from shardwise.runtime.frozen_base import check_resume, omit_frozen, resume_base


def _model() -> GPT:
    model = GPT(GPTConfig(vocab_size=11, block_size=4, n_layer=1, n_head=1, n_embd=4))
    model.wte.requires_grad_(False)  # tied: lm_head.weight is the same parameter
    model.blocks[0].attn.qkv.weight.requires_grad_(False)
    return model


def test_frozen_keys_name_every_use_of_a_frozen_parameter():
    assert frozen_keys(_model()) == ["blocks.0.attn.qkv.weight", "lm_head.weight", "wte.weight"]


def test_save_frozen_false_needs_a_pretrained_base():
    cfg = apply_overrides(Config(), {"train.save_frozen": "false"})
    with pytest.raises(ValueError, match="train.save_frozen = false .* --model.pretrained DIR"):
        check_numbers(cfg)
    check_numbers(Config())  # the default saves everything


def test_omit_frozen_drops_model_pieces_and_names_them():
    model = _model()
    pieces = [SimpleNamespace(key=f"model/{k}") for k in model.state_dict()] + [SimpleNamespace(key="zero/0/exp_avg")]
    cfg = Config()
    state: dict = {}
    assert omit_frozen(pieces, state, model, cfg) == pieces and state == {}  # type: ignore[arg-type]
    off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_frozen=False))
    kept = omit_frozen(pieces, state, model, off)  # type: ignore[arg-type]
    assert state[FROZEN_STATE] == frozen_keys(model)
    assert {p.key for p in kept} == {p.key for p in pieces} - {f"model/{k}" for k in frozen_keys(model)}
    assert drop_frozen(pieces, []) == pieces  # type: ignore[arg-type]


def test_resume_reads_the_base_only_when_checkpoints_leave_it_out():
    cfg = dataclasses.replace(Config(), model=dataclasses.replace(Config().model, pretrained="/base"))
    off = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, save_frozen=False))
    assert resume_base(cfg) == "" and resume_base(off) == "/base"
    slim = SimpleNamespace(omitted={"wte.weight"}, path="runs/r/checkpoints/step_000002")
    check_resume(slim, off)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="left out 1 frozen parameters .* --train.save_frozen false"):
        check_resume(slim, cfg)  # type: ignore[arg-type]
    check_resume(SimpleNamespace(omitted=set(), path="x"), cfg)  # type: ignore[arg-type]
