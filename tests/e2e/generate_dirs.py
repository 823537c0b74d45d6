"""Tiny model directories and tokenizers for the ``shardwise generate`` tests, made here (no downloads).

* ``bpe_tokenizer()``: a byte-level BPE (``tokenizers``) trained on a few sentences, 300 ids, ``<eos>`` = 0.
* ``word_tokenizer(words)``: a whitespace word-level tokenizer whose ids are the positions in ``words``.
* ``gpt2_dir(path, ...)``: a GPT-2 model directory written with ``safetensors`` alone (no ``transformers``):
  the reference GPT's random weights under GPT-2's keys, ``config.json``, a ``tokenizer.json``.
* ``gen_dir_setup``, ``gen_run_setup``: setups of ``tests/e2e/test_bad_inputs.py``'s ``generate`` cases.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

CORPUS = ["the quick brown fox jumps over the lazy dog", "a tiny corpus for a tiny tokenizer, made in the test",
          "hello world: shardwise generates text from a model"] * 10


def bpe_tokenizer(vocab: int = 300) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<eos>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def word_tokenizer(words: list[str]) -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


def gpt2_dir(path: Path, *, vocab: int, positions: int, tokenizer: Any | None = None, seed: int = 0) -> Path:
    """A GPT-2 directory of a random 1-layer reference GPT (``vocab`` ids, ``positions`` context)."""
    from safetensors.torch import save_file

    from shardwise.checkpoint.hf_dir import gpt2_config_from_gpt, gpt2_key
    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab, block_size=positions, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied: GPT-2 files leave the head out
            continue
        key, transposed = gpt2_key(name)
        tensors[key] = (t.t() if transposed else t).contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(gpt2_config_from_gpt(cfg.to_dict())))
    if tokenizer is not None:
        tokenizer.save(str(path / "tokenizer.json"))
    return path


def gen_dir_setup(vocab: int = 8, positions: int = 8, tokenizer: bool = True) -> Callable[[Path], None]:
    """Bad-input setup: a tiny GPT-2 directory ``m`` (``gpt2_dir``) whose word tokenizer knows ``w0 .. w11`` (ids
    0-11: more than the model's ``vocab``)."""
    def setup(root: Path) -> None:
        tok = word_tokenizer([f"w{i}" for i in range(12)]) if tokenizer else None
        gpt2_dir(root / "m", vocab=vocab, positions=positions, tokenizer=tok)
    return setup


def gen_run_setup(data_path: str = "", checkpoint: bool = True) -> Callable[[Path], None]:
    """Bad-input setup: a run directory ``runs/r`` whose checkpoint index names no tensors (the refusals read none)
    and whose saved config trained on ``data_path``; without ``checkpoint`` only its ``config.json``."""
    def setup(root: Path) -> None:
        from shardwise.runtime.config import Config

        cfg = Config().to_dict()
        cfg["data"]["path"] = data_path
        run = root / "runs" / "r"
        run.mkdir(parents=True)
        (run / "config.json").write_text(json.dumps(cfg))
        if checkpoint:
            (run / "checkpoints" / "step_000001").mkdir(parents=True)
            (run / "checkpoints" / "latest").write_text("step_000001\n")
            (run / "checkpoints" / "step_000001" / "index.json").write_text(json.dumps({
                "format": "shardwise-sharded-v1", "step": 1, "mesh": {"dp": 1, "tp": 1}, "world_size": 1,
                "state": {"config": cfg}, "tensors": {}}))
    return setup
