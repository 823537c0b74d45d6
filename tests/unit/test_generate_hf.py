"""``shardwise generate DIR`` on Hugging Face directories against ``transformers``' own ``generate`` on the same
weights: greedy token ids equal for GPT-2, a grouped-query Llama and Qwen2 (attention biases), and an EOS from
``config.json`` stops both at the same token. The directories are written by ``save_pretrained`` from random
models here, the tokenizer is trained here (no downloads); the command runs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise import cli
from tests.e2e.generate_dirs import bpe_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

PROMPT = "the quick brown fox"
NEW = 24
SMALL = {"vocab_size": 300, "initializer_range": 0.2, "bos_token_id": None, "eos_token_id": None}
LLAMA = {**SMALL, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128}
CASES = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {**SMALL, "n_positions": 64, "n_embd": 32, "n_layer": 2, "n_head": 4,
                                               "activation_function": "gelu"}),
    "llama-gqa": ("LlamaForCausalLM", "LlamaConfig", {**LLAMA, "rope_theta": 1000.0}),
    "qwen2-bias": ("Qwen2ForCausalLM", "Qwen2Config", {**LLAMA, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny ops one token at a time: a second intra-op thread only costs on a loaded machine (no numbers change
    between the two sides, which run in this same setting)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def save(tmp_path: Path, name: str, tokenizer) -> Path:
    cls, cfg_cls, fields = CASES[name]
    torch.manual_seed(0)
    model = getattr(transformers, cls)(getattr(transformers, cfg_cls)(**fields))
    with torch.no_grad():  # biases and norms away from zero and one: a misplaced one changes the tokens
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    out = tmp_path / name
    model.save_pretrained(out)
    tokenizer.save(str(out / "tokenizer.json"))
    return out


def theirs(directory: Path, ids: list[int], new: int) -> list[int]:
    model = getattr(transformers, CASES[directory.name][0]).from_pretrained(directory).eval()
    prompt = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
                             pad_token_id=0)
    return out[0, len(ids):].tolist()


def ours(directory: Path, capsys, *extra: str) -> dict:
    rc = cli.main(["generate", str(directory), "--prompt", PROMPT, "--device", "cpu", "--json", *extra])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "tokens/s" in err
    return json.loads(out)


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_equal_transformers_generate(name, tmp_path, tokenizer, capsys):
    directory = save(tmp_path, name, tokenizer)
    got = ours(directory, capsys, "--temperature", "0", "--max-new-tokens", str(NEW))
    ids = tokenizer.encode(PROMPT).ids
    assert got["prompt_tokens"] == ids
    want = theirs(directory, ids, NEW)
    assert len(want) == NEW and len(set(want)) > 4  # a varied continuation, not one token repeated
    assert got["tokens"] == want
    assert got["completion"] == tokenizer.decode(ids + want)[len(PROMPT):]


def test_eos_from_config_stops_both_at_the_same_token(tmp_path, tokenizer, capsys):
    directory = save(tmp_path, "llama-gqa", tokenizer)
    ids = tokenizer.encode(PROMPT).ids
    free = theirs(directory, ids, NEW)
    eos = free[5]  # the sixth greedy token (or an earlier occurrence of it) ends the generation now
    for name in ("config.json", "generation_config.json"):
        raw = json.loads((directory / name).read_text())
        raw["eos_token_id"] = eos
        (directory / name).write_text(json.dumps(raw))
    want = theirs(directory, ids, NEW)
    assert want == free[:free.index(eos) + 1]
    assert ours(directory, capsys, "--temperature", "0", "--max-new-tokens", str(NEW))["tokens"] == want


def test_a_seeded_sample_repeats_and_stays_in_the_top_k(tmp_path, tokenizer, capsys):
    directory = save(tmp_path, "qwen2-bias", tokenizer)
    flags = ["--temperature", "1.5", "--top-k", "3", "--seed", "11", "--max-new-tokens", "12"]
    first, again = ours(directory, capsys, *flags), ours(directory, capsys, *flags)
    other = ours(directory, capsys, *[("12" if f == "11" else f) for f in flags])  # --seed 12
    assert first["tokens"] == again["tokens"] and first["seed"] == 11
    assert first["tokens"] != other["tokens"]
    model = transformers.Qwen2ForCausalLM.from_pretrained(directory).eval()
    seq = torch.tensor([first["prompt_tokens"] + first["tokens"]])
    with torch.no_grad():
        logits = model(seq).logits[0, len(first["prompt_tokens"]) - 1:-1]  # the prediction of each drawn token
    top3 = logits.topk(3, dim=-1).indices.tolist()
    assert all(t in row for t, row in zip(first["tokens"], top3))
