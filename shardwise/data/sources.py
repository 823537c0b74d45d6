"""Where ``shardwise train``'s tokens come from: training windows, validation windows, and their checks.

``data.path`` is a dataset directory of ``shardwise prepare`` (memory-mapped uint16/uint32 shards, read where a
window falls: nothing is loaded whole), a text file (byte-level tokens), a uint16 ``.bin``, or empty (the
generated corpus). Validation data is ``data.val_path`` (the same kinds; a prepared directory gives its
validation split, or its training split when it has none) or else the validation split of a prepared
``data.path``. Loss-masked (supervised fine-tuning) datasets carry a mask: their windows' prompt targets are
``IGNORE``.

``check_data`` runs in the launcher before any rank starts: every problem is one ``ValueError`` line — among them
a JSON Lines file given as a path (it must be prepared first) and token ids at or above the model's vocabulary (a
file's are all read; a prepared split's recorded ``max_id`` and its shards, read whole when small, sampled when
large). The windows of ``open_data`` check their ids as they are read, so one the sampled check missed fails as a
one-line ``DataError`` in the rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from .windows import DataError, TokenWindows, out_of_vocab

__all__ = ["TrainData", "open_data", "check_data", "open_source", "prepared_vocab", "DataError"]


class Config(Protocol):
    """What is read here of ``shardwise.runtime.config.Config`` (the data room does not import the runtime):
    ``data.path/format/val_path/global_batch``, ``model.block_size/vocab_size/pretrained/hf_config``,
    ``train.eval_every``."""

    data: Any
    model: Any
    train: Any


@dataclass(frozen=True)
class Source:
    """One data path opened: its token stream(s), mask(s), the vocabulary bound of its ids, and where the
    validation split is (prepared datasets). ``tokens``: a 1-D tensor or a prepared ``TokenStream``."""

    path: str
    tokens: Any
    mask: Any
    vocab: int
    """Ids are < vocab: the tokenizer's vocabulary (prepared), or the largest id + 1 (files)."""
    fingerprint: str
    """The tokenizer's fingerprint (prepared), "bytes" (text), "" (unknown: a .bin or the generated corpus)."""
    val_tokens: Any = None
    val_mask: Any = None
    eos_id: int | None = None
    """The id that ends each packed document (prepared datasets); None: the stream has no document boundaries."""


def open_source(path: str, fmt: str = "auto") -> Source:
    """Open ``path`` (module docstring). Raises ``ValueError`` (one line) when it cannot be used."""
    from .corpus import load_corpus

    if fmt == "prepared" or (fmt == "auto" and path and Path(path).is_dir()):
        from .prepared import open_prepared

        ds = open_prepared(path)
        val = ds.val
        return Source(path, ds.train.tokens, ds.train.mask, ds.vocab_size, ds.tokenizer_fingerprint,
                      val.tokens if val is not None else None, val.mask if val is not None else None, ds.eos_id)
    if fmt == "auto" and Path(path).suffix.lower() in (".jsonl", ".json") and Path(path).is_file():
        raise ValueError(f"{path!r} is JSON Lines, which must be prepared first (training would read its raw JSON "
                         f"bytes): shardwise prepare {path} --tokenizer TOKENIZER --out DIR, then --data.path DIR")
    tokens = load_corpus(path, fmt)
    top = int(tokens.to(torch.int32).max()) if tokens.numel() else 0  # uint16 has no max kernel
    binary = fmt == "bin" or (fmt == "auto" and Path(path).suffix == ".bin")
    return Source(path, tokens, None, top + 1, "" if binary or not path else "bytes")


def prepared_vocab(path: str, fmt: str = "auto") -> int:
    """The vocabulary size a prepared dataset's index states (``shardwise prepare`` writes it), without opening
    its shards; 0 when ``path`` is not a prepared dataset or its index cannot be read (``check_data`` says why)."""
    if not path or not (fmt == "prepared" or (fmt == "auto" and Path(path).is_dir())):
        return 0
    from .prepared import _read_index

    try:
        vocab = _read_index(Path(path)).get("vocab_size")
    except (ValueError, OSError):
        return 0
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0 else 0


@dataclass(frozen=True)
class TrainData:
    """The training windows, the validation windows (None without validation data), whether targets are
    loss-masked (then the trainer weighs every counted token alike: ``token_loss.py``) and the EOS id that
    separates packed documents (None: none known)."""

    train: TokenWindows
    val: TokenWindows | None
    masked: bool
    eos_id: int | None = None


def _val_source(cfg: Config, main: Source) -> tuple[Source | None, str]:
    """The validation tokens and where they came from (for messages)."""
    if cfg.data.val_path:
        src = open_source(cfg.data.val_path, "auto")
        if src.val_tokens is not None:  # a prepared directory: its validation split
            src = Source(src.path, src.val_tokens, src.val_mask, src.vocab, src.fingerprint)
        return src, f"data.val_path = {cfg.data.val_path!r}"
    if main.val_tokens is not None:
        return Source(main.path, main.val_tokens, main.val_mask, main.vocab, main.fingerprint), \
            f"the validation split of data.path = {main.path!r}"
    return None, ""


def open_data(cfg: Config) -> TrainData:
    """This rank's view of the data (memory maps; nothing communicated). Validation only with eval_every."""
    main = open_source(cfg.data.path, cfg.data.format)
    block = cfg.model.block_size
    vocab = cfg.model.vocab_size  # a damaged shard's id fails as one line here, not inside the embedding
    train = TokenWindows(main.tokens, block, mask=main.mask, vocab=vocab, source=f"data.path = {main.path!r}")
    val = None
    if cfg.train.eval_every:
        src, where = _val_source(cfg, main)
        val = (TokenWindows(src.tokens, block, mask=src.mask, vocab=vocab, source=where)
               if src is not None else None)
    return TrainData(train, val, masked=main.mask is not None or (val is not None and val.mask is not None),
                     eos_id=main.eos_id)


def check_data(cfg: Config) -> None:
    """Every data problem of a launch, before any rank starts (``ValueError``, one line each): the training
    data holds at least one global batch, its ids fit the model's vocabulary, validation data exists when
    ``train.eval_every`` asks for it, matches the training data's tokenizer and holds one global batch."""
    main = open_source(cfg.data.path, cfg.data.format)
    what = f"data.path = {cfg.data.path!r}"
    _check_windows(main, what, cfg, "one step's")
    _check_vocab(main, what, cfg)
    _check_ids(main, what, cfg)
    if getattr(cfg.data, "document_mask", "auto") == "true" and main.eos_id is None:
        raise ValueError(f"data.document_mask = true needs packed documents with an EOS between them, but {what} "
                         f"has no document boundaries (a text file, a .bin or the generated corpus); prepare it with "
                         f"shardwise prepare (documents end with the tokenizer's EOS), or set --data.document_mask "
                         f"false")
    if cfg.data.val_path and not cfg.train.eval_every:
        print(f"shardwise train: warning: data.val_path is set but train.eval_every = 0: no validation runs; e.g. "
              f"--train.eval_every 100", flush=True)
    if not cfg.train.eval_every:
        return
    val, where = _val_source(cfg, main)
    if val is None:
        raise ValueError(f"train.eval_every = {cfg.train.eval_every} needs validation data, but {what} "
                         f"{_no_val_hint(main)}")
    if val.fingerprint != main.fingerprint and main.fingerprint and val.fingerprint:
        raise ValueError(f"{where} was tokenized with another tokenizer ({val.fingerprint[:12]}) than {what} "
                         f"({main.fingerprint[:12]}); prepare both with the same --tokenizer")
    _check_windows(val, where, cfg, "one validation batch's")
    _check_vocab(val, where, cfg)
    _check_ids(val, where, cfg)


def _check_windows(src: Source, what: str, cfg: Config, role: str) -> None:
    n = src.tokens.numel() if isinstance(src.tokens, torch.Tensor) else len(src.tokens)
    windows = (n - 1) // cfg.model.block_size
    if windows < cfg.data.global_batch:
        raise ValueError(f"{what} holds {n} tokens = {windows} windows of model.block_size={cfg.model.block_size}, "
                         f"fewer than {role} data.global_batch={cfg.data.global_batch}; use more data or a smaller "
                         f"global batch / block size")


def _check_vocab(src: Source, what: str, cfg: Config) -> None:
    if src.vocab <= cfg.model.vocab_size:
        return
    prepared = src.fingerprint not in ("", "bytes")
    origin = (f"was tokenized with a vocabulary of {src.vocab} tokens" if prepared
              else f"contains token id {src.vocab - 1}")
    if cfg.model.hf_config or cfg.model.pretrained:
        fix = f"use data tokenized for that model, or a config.json with vocab_size >= {src.vocab}"
        model = f"the model's vocab_size = {cfg.model.vocab_size} (model.hf_config / model.pretrained)"
    else:
        fix, model = f"set --model.vocab_size {src.vocab} or larger", f"model.vocab_size = {cfg.model.vocab_size}"
    raise ValueError(f"{what} {origin} but {model}; {fix}")


def _check_ids(src: Source, what: str, cfg: Config) -> None:
    """A prepared split's ids against the model's vocabulary: the largest id ``dataset.json`` records, and the
    ids a bounded read of the shards finds (``TokenStream.largest``: all of a small split), so a damaged shard
    fails here as one line. (Files and ``.bin`` were read whole by ``open_source``: ``src.vocab`` covers them.)"""
    if not hasattr(src.tokens, "largest"):
        return
    vocab = cfg.model.vocab_size
    recorded = getattr(src.tokens, "recorded_max", None)
    if recorded is not None and recorded >= vocab:
        raise ValueError(out_of_vocab(recorded, vocab, what, "the max_id dataset.json records"))
    top, shard, _ = src.tokens.largest()
    if top >= vocab:
        raise ValueError(out_of_vocab(top, vocab, what, f"shard {shard}"))


def _no_val_hint(main: Source) -> str:
    """Why ``main`` has no validation data and what gives it some — commands that work for that kind of data."""
    off = "or turn validation off with --train.eval_every 0"
    if main.fingerprint not in ("", "bytes"):  # a prepared dataset
        return (f"has no validation split (prepared with --val-fraction 0); prepare it again with one: shardwise "
                f"prepare INPUT... --tokenizer {main.path}/tokenizer.json --out {main.path} --val-fraction 0.01 "
                f"--force, pass --data.val_path PATH, {off}")
    if not main.path:
        return (f"is the generated corpus, which has no validation split; pass --data.val_path PATH (a held-out text "
                f"file), {off}")
    if main.fingerprint == "bytes":
        return (f"is a text file (byte-level tokens), which has no validation split; pass --data.val_path PATH (held-"
                f"out text), {off}, or tokenize it with a split: shardwise prepare {main.path} --tokenizer "
                f"TOKENIZER --out DIR --val-fraction 0.01 (a lone text file is cut into documents at blank lines or "
                f"line ends), then --data.path DIR")
    return f"is a file of token ids, which has no validation split; pass --data.val_path PATH (held-out ids), {off}"
