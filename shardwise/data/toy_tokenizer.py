"""A small byte-level BPE tokenizer trained here, for examples, tests and benchmarks (no download anywhere).

``train_bpe(files, vocab_size, out_path)`` trains a GPT-2-style byte-level BPE (every byte representable, so any
text encodes) with ``<|endoftext|>`` as its one special token, and writes a Hugging Face ``tokenizer.json`` that
``shardwise prepare --tokenizer`` and ``transformers.PreTrainedTokenizerFast(tokenizer_file=...)`` load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

__all__ = ["train_bpe", "EOS"]

EOS = "<|endoftext|>"


def train_bpe(files: Iterable[str | Path], vocab_size: int, out_path: str | Path) -> Path:
    """Train on the text ``files`` and write ``tokenizer.json`` at ``out_path`` (a file path, or a directory that
    gets ``tokenizer.json``). Returns the file written. The ids: ``<|endoftext|>`` = 0, the 256 byte symbols,
    then the merges, up to ``vocab_size`` in all."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    names = [str(f) for f in files]
    if not names:
        raise ValueError("train_bpe needs at least one text file to learn merges from; pass files=[...]")
    if vocab_size < 257:
        raise ValueError(f"vocab_size must be >= 257 (256 bytes + {EOS}), got {vocab_size}; e.g. 8192")
    out = Path(out_path)
    if out.is_dir():
        out = out / "tokenizer.json"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(names, trainer)
    tok.save(str(out))
    return out
