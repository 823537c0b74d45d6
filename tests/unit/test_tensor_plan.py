"""Pure parts of tensor parallelism: plan matching, style validation, the GPT plan, RNG streams (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.tensor import gpt_plan
from shardwise.parallel.tensor_rng import RNGStreams, split_seed
from shardwise.parallel.tensor_styles import check_style, match_plan

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


def test_rng_streams_leave_the_shared_stream_in_place():
    torch.manual_seed(5)
    expected = torch.rand(6)
    torch.manual_seed(5)
    streams = [RNGStreams(torch.device("cpu"), seed=5, coord=c) for c in range(2)]
    draws = []
    for s in streams:
        s.enter_split()
        draws.append(torch.rand(4))
        s.leave_split()
    assert not torch.equal(draws[0], draws[1])  # independent split streams per tp coord
    assert torch.equal(torch.rand(6), expected)  # the shared stream never moved
    streams[0].enter_split()
    again = torch.rand(4)
    streams[0].leave_split()
    assert not torch.equal(again, draws[0])  # the split stream continues where it left off
    assert len({split_seed(5, c) for c in range(8)} | {5}) == 9
