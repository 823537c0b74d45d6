"""Pure parts of tensor parallelism: plan matching, style validation, the GPT plan, RNG streams (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.tensor.apply_plan import gpt_plan
from shardwise.parallel.tensor.rng import RNGStreams, split_seed
from shardwise.parallel.tensor.styles import check_style, match_plan

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=32)


def _names() -> list[str]:
    return [n for n, _ in GPT(CFG).named_modules()]


def test_match_plan_in_module_order():
    got = match_plan(_names(), {"blocks.*.mlp.proj": sw.RowParallel(), "blocks.*.mlp.fc": sw.ColumnParallel()})
    assert list(got) == ["blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj"]
    assert got["blocks.1.mlp.proj"] == sw.RowParallel()


def test_match_plan_errors():
    with pytest.raises(ValueError, match=r"'blocks\.\*\.ffn' matches no module.*wte"):
        match_plan(_names(), {"blocks.*.ffn": sw.ColumnParallel()})
    with pytest.raises(ValueError, match="two plan patterns"):
        match_plan(_names(), {"blocks.0.mlp.fc": sw.ColumnParallel(), "blocks.*.mlp.fc": sw.RowParallel()})
    with pytest.raises(TypeError, match="must be one of"):
        match_plan(_names(), {"wte": "vocab"})


def test_gpt_plan_covers_the_model():
    plain, sp = gpt_plan(CFG), gpt_plan(CFG, sequence_parallel=True)
    assert plain["blocks.*.attn.qkv"] == sw.QKVParallel(4)
    assert set(sp) - set(plain) == {"wpe", "blocks.*.ln_*", "ln_f"}
    assert sp["wpe"] == sw.SequenceParallel(slice_output=0)
    matched = match_plan(_names(), sp)
    assert {"wte", "lm_head", "blocks.1.ln_2", "blocks.0.attn.proj"} <= set(matched)


def test_check_style():
    model = GPT(CFG)
    attn = model.blocks[0].attn
    check_style("q", attn.qkv, attn, sw.QKVParallel(4), 4, False)
    check_style("fc", model.blocks[0].mlp.fc, None, sw.ColumnParallel(), 3, False)  # uneven features: fine
    with pytest.raises(ValueError, match="4 attention heads do not divide over tp=3"):
        check_style("q", attn.qkv, attn, sw.QKVParallel(4), 3, False)
    with pytest.raises(ValueError, match="parent module's 'n_head'"):
        check_style("q", attn.qkv, attn, sw.QKVParallel(2), 2, False)
    with pytest.raises(ValueError, match="applies to nn.Linear, got LayerNorm"):
        check_style("ln", model.ln_f, model, sw.RowParallel(), 2, False)
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        check_style("ln", model.ln_f, model, sw.SequenceParallel(), 2, False)
    with pytest.raises(ValueError, match="max_norm"):
        check_style("e", nn.Embedding(8, 4, max_norm=1.0), None, sw.VocabParallel(), 2, False)


def _region(coord: int, shared_seed: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(draws before, inside a split region, after it) on a fresh shared stream."""
    torch.manual_seed(shared_seed)
    streams = RNGStreams(torch.device("cpu"), seed=0, coord=coord)
    before = torch.rand(3)
    streams.enter_split()
    inside = torch.rand(4)
    streams.leave_split()
    return before, inside, torch.rand(6)


def test_rng_split_regions():
    b0, in0, after0 = _region(0)
    b1, in1, after1 = _region(1)
    assert torch.equal(b0, b1) and torch.equal(after0, after1)  # the shared stream stays in step across coords
    assert not torch.equal(in0, in1)  # independent split masks per tp coord
    assert torch.equal(_region(0)[1], in0)  # a function of the shared state at entry: replayable
    assert not torch.equal(_region(0, shared_seed=6)[1], in0)
    assert len({split_seed(1, 5, c) for c in range(8)}) == 8
