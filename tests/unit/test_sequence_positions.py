"""``sequence_layout``: the global positions of a module's local tokens (context parallelism holds chunks of the
sequence, not positions 0..t-1). The GPT embeds them with ``wpe``; the Llama family's attention rotates q/k by
them. A slice of a sequence run with its true positions must match the full sequence's rows at the embedding /
rotary level (attention itself sees other keys, which is context parallelism's business)."""

from __future__ import annotations

import pytest
import torch

from shardwise.models import GPT, GPTConfig
from shardwise.models.hf_config import HFDecoderConfig, load_hf_config
from shardwise.models.kv_cache import KVCache
from shardwise.models.llama import Attention, Llama, rotary_tables


class Positions:
    """A stub layout: the local tokens sit at ``index`` (a (t,) LongTensor) of the global sequence."""

    def __init__(self, index: torch.Tensor) -> None:
        self.index = index
        self.calls: list[int] = []

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        self.calls.append(local_len)
        assert local_len == self.index.numel()
        return self.index.to(device)


def _rows() -> list[torch.Tensor]:
    """Slices of a 16-token sequence: a tail, two chunks (a context-parallel rank's), a permutation."""
    g = torch.Generator().manual_seed(0)
    return [torch.arange(5, 16), torch.cat([torch.arange(0, 4), torch.arange(12, 16)]), torch.randperm(16, generator=g)]


@pytest.fixture
def llama_config() -> HFDecoderConfig:
    return load_hf_config("examples/hf/tiny-llama.json")


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)).eval()


def _embedding(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """The input of the first block (``drop(wte + wpe)``) of ``model(idx)``."""
    seen: list[torch.Tensor] = []
    handle = model.blocks[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        model(idx)
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.parametrize("which", range(3))
def test_gpt_embeds_the_layout_positions(which):
    model = _gpt()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    full = _embedding(model, idx)
    rows = _rows()[which]
    model.sequence_layout = Positions(rows)
    torch.testing.assert_close(_embedding(model, idx[:, rows]), full[:, rows], rtol=0, atol=0)
    assert model.sequence_layout.calls == [rows.numel()]
    # the pipeline's first unit embeds the same positions
    embed = model.pipeline_units()[0].fn
    torch.testing.assert_close(embed(idx[:, rows]), full[:, rows], rtol=0, atol=0)


def test_gpt_without_layout_is_unchanged_and_decode_ignores_it():
    model = _gpt()
    assert GPT.sequence_layout is None and model.sequence_layout is None
    idx = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(2))
    plain = model(idx)
    model.sequence_layout = Positions(torch.arange(3, 13))  # would shift forward's positions, not decode's
    cache = KVCache(16)
    torch.testing.assert_close(model.decode(idx, cache), plain, rtol=0, atol=0)
    assert model.sequence_layout.calls == []


def test_gpt_layout_of_the_wrong_length_is_refused():
    model = _gpt()
    model.sequence_layout = type("Bad", (), {"positions": lambda self, t, device: torch.arange(t + 1)})()
    with pytest.raises(ValueError, match="must have shape"):
        model(torch.zeros(1, 4, dtype=torch.long))


def test_rotary_tables_positions_equal_start(llama_config):
    for start, t in ((0, 12), (7, 5)):
        cos, sin = rotary_tables(t, llama_config, torch.device("cpu"), torch.float32, start=start)
        cos_p, sin_p = rotary_tables(t, llama_config, torch.device("cpu"), torch.float32,
                                     positions=torch.arange(start, start + t))
        assert torch.equal(cos, cos_p) and torch.equal(sin, sin_p)
    with pytest.raises(ValueError, match="positions must have shape"):
        rotary_tables(3, llama_config, torch.device("cpu"), torch.float32, positions=torch.arange(4))


@pytest.mark.parametrize("which", range(3))
def test_llama_attention_rotates_by_the_layout_positions(llama_config, which):
    torch.manual_seed(0)
    attn = Attention(llama_config)
    x = torch.randn(2, 16, llama_config.hidden_size)
    q, k, v = attn._heads(x)  # (b, heads, t, hd)
    rows = _rows()[which]
    attn.sequence_layout = Positions(rows)
    q_s, k_s, v_s = attn._heads(x[:, rows])
    for full, part in ((q, q_s), (k, k_s), (v, v_s)):
        torch.testing.assert_close(part, full[:, :, rows], rtol=0, atol=0)
    assert attn.sequence_layout.calls == [rows.numel()]


def test_llama_attention_declares_the_layout_and_decode_ignores_it(llama_config):
    assert Attention.sequence_layout is None
    torch.manual_seed(0)
    model = Llama(llama_config, 16).eval()
    idx = torch.randint(0, llama_config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(3))
    plain = model(idx)
    for layer in model.model.layers:  # a prefix 0..t-1 given explicitly: the same numbers
        layer.self_attn.sequence_layout = Positions(torch.arange(10))
    torch.testing.assert_close(model(idx), plain, rtol=0, atol=0)
    layouts = [layer.self_attn.sequence_layout for layer in model.model.layers]
    assert all(lay.calls == [10] for lay in layouts)
    cache = KVCache(16)
    torch.testing.assert_close(model.decode(idx, cache), plain, rtol=0, atol=0)
    assert all(lay.calls == [10] for lay in layouts)  # decode reads the cache's positions, not the layout


def test_llama_first_chunk_matches_full_sequence(llama_config):
    """Causal attention: the first chunk sees the same keys alone as in the full sequence; a later chunk given its
    positions rotates its keys exactly as the full sequence does (checked on the rotated keys above)."""
    torch.manual_seed(0)
    model = Llama(llama_config, 16).eval()
    idx = torch.randint(0, llama_config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(4))
    full = model(idx)
    for layer in model.model.layers:
        layer.self_attn.sequence_layout = Positions(torch.arange(6))
    torch.testing.assert_close(model(idx[:, :6]), full[:, :6], rtol=1e-5, atol=1e-6)
