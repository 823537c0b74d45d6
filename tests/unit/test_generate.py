"""``sw.generate`` and the key/value cache of the reference GPT and the Llama-family decoder: decoding with the cache
gives the tokens of a full forward per step, and logits equal to the full forward's; sampling flags behave as
documented; bad arguments are one line. The reference is always the model's unchanged ``forward`` (the training
path), never the cache code itself."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.models import GPT, GPTConfig
from shardwise.models.generate import pick_token
from shardwise.models.hf_config import hf_config_from_dict
from shardwise.models.kv_cache import KVCache
from shardwise.models.llama import Llama

LLAMA = {"model_type": "llama", "vocab_size": 89, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 96, "rope_theta": 500.0}


def _noisy(model: torch.nn.Module) -> torch.nn.Module:
    """Weights far from the init's small values, so that logits are spread and every position matters."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    gpt = _noisy(GPT(GPTConfig(vocab_size=83, block_size=80, n_layer=2, n_head=4, n_embd=32, tie_weights=True)))
    llama = _noisy(Llama(hf_config_from_dict(LLAMA), block_size=96))  # GQA: 4 query heads share 2 kv heads
    qwen = _noisy(Llama(hf_config_from_dict({**LLAMA, "model_type": "qwen2", "tie_word_embeddings": True}), 96))
    return {"gpt": gpt, "llama-gqa": llama, "qwen2-bias": qwen}


MODELS = models()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Hundreds of tiny ops: on a loaded machine, waking a second intra-op thread for each costs more than the op
    (numbers are compared within one setting, so this changes no assertion)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _prompt(model: torch.nn.Module, b: int, t: int, seed: int = 1) -> torch.Tensor:
    vocab = model.config.vocab_size
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_logits_equal_the_full_forward(name):
    """Prefill of 5, a chunk of 7 after the cache (the shifted causal mask), then one token at a time: each
    position's logits equal those of one full forward of the whole sequence (rotary positions continue)."""
    model = MODELS[name]
    seq = _prompt(model, 2, 40)
    with torch.no_grad():
        full = model(seq)  # (2, 40, v): the training forward
        cache = KVCache(40)
        parts = [model.decode(seq[:, :5], cache), model.decode(seq[:, 5:12], cache)]
        parts += [model.decode(seq[:, i:i + 1], cache) for i in range(12, 40)]
    got = torch.cat(parts, dim=1)
    assert cache.length == 40
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5 * float(full.abs().max()))
    assert not torch.equal(full[:, 20], full[:, 21])  # positions differ: a cache that ignored them would show


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_tokens_equal_uncached_tokens(name):
    model = MODELS[name]
    prompt = _prompt(model, 3, 6)
    cached = sw.generate(model, prompt, max_new_tokens=30, temperature=0)
    full = sw.generate(model, prompt, max_new_tokens=30, temperature=0, use_cache=False)
    assert cached.shape == (3, 36) and torch.equal(cached[:, :6], prompt)
    assert torch.equal(cached, full)
    # greedy means argmax of the full forward at every step
    with torch.no_grad():
        logits = model(cached[:, :-1])[:, 5:]  # (3, 30, v): the prediction for each generated position
    assert torch.equal(logits.argmax(-1), cached[:, 6:])
    assert len(set(cached[0, 6:].tolist())) > 3  # not one token repeated: the check has teeth
    sampled = [sw.generate(model, prompt, 20, temperature=0.9, top_k=10, use_cache=c,
                           generator=torch.Generator().manual_seed(5)) for c in (True, False)]
    assert torch.equal(*sampled)


def test_empty_cache_decode_is_the_forward_bit_for_bit():
    for model in MODELS.values():
        seq = _prompt(model, 2, 17)
        with torch.no_grad():
            assert torch.equal(model.decode(seq, KVCache(17)), model(seq))


def test_seed_reproduces_a_sample_and_another_seed_does_not():
    model = MODELS["gpt"]
    prompt = _prompt(model, 1, 4)[0]  # 1-D prompt -> 1-D result
    draws = [sw.generate(model, prompt, 40, temperature=1.0, generator=torch.Generator().manual_seed(s))
             for s in (7, 7, 8)]
    assert draws[0].shape == (44,)
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


def test_top_k_keeps_the_k_likeliest_and_temperature_zero_is_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.5, -1.0, 0.5]]).repeat(400, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = pick_token(logits, 1.0, 2, gen)
    assert set(top2.tolist()) == {1, 3}  # both drawn over 400 rows, nothing else
    everything = pick_token(logits, 1.0, 0, gen)
    assert len(set(everything.tolist())) >= 5  # top_k 0: the whole vocabulary stays
    assert pick_token(logits, 0.0, 0).tolist() == [1] * 400
    cold = pick_token(logits, 0.05, 0, gen)  # a low temperature all but always picks the maximum
    assert (cold == 1).float().mean() > 0.99


def test_eos_stops_a_row_and_pads_finished_rows():
    model = MODELS["llama-gqa"]
    prompt = _prompt(model, 2, 5)
    free = sw.generate(model, prompt, 12, temperature=0)
    eos = int(free[0, 5 + 3])  # row 0's fourth new token
    first = {r: next((i for i, t in enumerate(free[r, 5:].tolist()) if t == eos), None) for r in (0, 1)}
    stopped = sw.generate(model, prompt, 12, temperature=0, eos_token_id=eos)
    assert first[0] is not None and first[0] <= 3
    ends = [first[r] if first[r] is not None else 11 for r in (0, 1)]
    assert stopped.size(1) == 5 + max(ends) + 1  # until every row is finished
    for r in (0, 1):
        n = ends[r] + 1
        assert torch.equal(stopped[r, :5 + n], free[r, :5 + n])  # identical up to and including its EOS
        assert (stopped[r, 5 + n:] == eos).all()  # then padded with EOS


@pytest.mark.parametrize("kwargs,match", [
    ({"max_new_tokens": 0}, "max_new_tokens = 0 must be an int >= 1"),
    ({"temperature": -0.5}, "temperature = -0.5 must be >= 0"),
    ({"top_k": -1}, "top_k = -1 must be an int >= 0"),
    ({"max_new_tokens": 70}, r"prompt \(12 tokens\) \+ max_new_tokens \(70\) = 82 exceeds the model's context of 80"),
])
def test_bad_arguments_are_one_line(kwargs, match):
    model = MODELS["gpt"]
    args = {"max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=match) as info:
        sw.generate(model, _prompt(model, 1, 12), **args)
    assert "\n" not in str(info.value)


def test_bad_prompts_are_one_line():
    model = MODELS["gpt"]
    with pytest.raises(ValueError, match=r"prompt token id 83 is outside the model's vocabulary \[0, 83\)"):
        sw.generate(model, torch.tensor([1, 83]), 3)
    with pytest.raises(ValueError, match="prompt_ids must be a non-empty"):
        sw.generate(model, torch.tensor([], dtype=torch.int64), 3)
    with pytest.raises(ValueError, match="the prompt .80 tokens. leaves no room .* at most 79 tokens"):
        sw.generate(model, _prompt(model, 1, 80), 3)
    with pytest.raises(ValueError, match="KVCache holds 4 positions"):
        with torch.no_grad():
            model.decode(_prompt(model, 1, 5), KVCache(4))
