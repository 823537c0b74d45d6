"""The tokenizer of ``shardwise prepare``: a Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package,
its end-of-text token, its fingerprint and the token dtype of the shards.

Only the main process loads it here (to check it and find the EOS id before any work starts); the encoding
workers load the copy placed in the output directory (``encode_worker.py``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TokenizerInfo", "load_tokenizer_info", "require_tokenizers", "EOS_CANDIDATES", "SIDE_FILES"]

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[SEP]")
"""End-of-text tokens looked for, in this order, when tokenizer_config.json names none (or has none)."""

SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
"""Copied into the output directory next to ``tokenizer.json`` when they sit next to the tokenizer given."""

INSTALL_DATA = 'pip install "shardwise[data]"'


def require_tokenizers() -> Any:
    """The ``tokenizers`` module, or a one-line ``ValueError`` naming the extra that installs it."""
    try:
        import tokenizers
    except ModuleNotFoundError:
        raise ValueError(f"shardwise prepare needs the tokenizers package; install it with: {INSTALL_DATA}") from None
    return tokenizers


@dataclass(frozen=True)
class TokenizerInfo:
    """What the prepared dataset records about its tokenizer."""

    file: Path
    """The ``tokenizer.json`` that was loaded."""
    sha256: str
    """sha256 of the file's bytes: the fingerprint a trainer compares against its own tokenizer."""
    vocab_size: int
    """Largest token id + 1, added tokens included."""
    eos_id: int
    eos_token: str
    side_files: tuple[Path, ...]
    """``tokenizer_config.json`` / ``special_tokens_map.json`` found next to ``file``."""

    @property
    def dtype(self) -> str:
        """``uint16`` when every id fits in 16 bits, else ``uint32``."""
        return "uint16" if self.vocab_size <= 65536 else "uint32"


def _tokenizer_file(path: Path) -> Path:
    if not path.exists():
        raise ValueError(f"--tokenizer {str(path)!r} does not exist; pass a tokenizer.json file or a model "
                         f"directory holding one")
    if path.is_dir():
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {str(path)!r} is a directory without tokenizer.json; pass a directory "
                             f"that has one (AutoTokenizer.save_pretrained writes it) or the file itself")
        return path / "tokenizer.json"
    return path


def _config_eos(directory: Path) -> str | None:
    """``eos_token`` of a ``tokenizer_config.json`` next to the tokenizer (a string or ``{"content": ...}``)."""
    cfg = directory / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        value = json.loads(cfg.read_text()).get("eos_token")
    except (ValueError, AttributeError):
        return None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _find_eos(tok: Any, file: Path, explicit: str | None) -> tuple[str, int]:
    if explicit is not None:
        tid = tok.token_to_id(explicit)
        if tid is None:
            raise ValueError(f"--eos-token {explicit!r} is not a token of {str(file)!r}; pass one of its special "
                             f"tokens, e.g. {_specials(tok)[:5]}")
        return explicit, tid
    named = _config_eos(file.parent)
    if named is not None and tok.token_to_id(named) is not None:
        return named, tok.token_to_id(named)
    specials = set(_specials(tok))
    for name in EOS_CANDIDATES:  # an added/special token first: a plain vocabulary entry "</s>" may be text
        if name in specials:
            return name, tok.token_to_id(name)
    for name in EOS_CANDIDATES:
        if tok.token_to_id(name) is not None:
            return name, tok.token_to_id(name)
    raise ValueError(f"{str(file)!r} has no end-of-text token (looked for {list(EOS_CANDIDATES)}); name the token "
                     f"that separates documents with --eos-token TOKEN, e.g. one of {_specials(tok)[:5]}")


def _specials(tok: Any) -> list[str]:
    return [t.content for _, t in sorted(tok.get_added_tokens_decoder().items())]


def load_tokenizer_info(path: str | Path, *, eos_token: str | None = None) -> TokenizerInfo:
    """Check and describe the tokenizer at ``path`` (a ``tokenizer.json`` or a directory holding one).
    Raises a one-line ``ValueError`` for a missing path or file, a file ``tokenizers`` cannot load, no EOS."""
    tokenizers = require_tokenizers()
    file = _tokenizer_file(Path(path))
    try:
        tok = tokenizers.Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises its own Exception type for a malformed file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ValueError(f"--tokenizer {str(file)!r} cannot be loaded by tokenizers ({first}); pass a Hugging "
                         f"Face tokenizer.json") from None
    name, eos_id = _find_eos(tok, file, eos_token)
    vocab_size = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    side = tuple(file.parent / n for n in SIDE_FILES if (file.parent / n).is_file())
    return TokenizerInfo(file=file, sha256=digest, vocab_size=vocab_size, eos_id=eos_id, eos_token=name,
                         side_files=side)
