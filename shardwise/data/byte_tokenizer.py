"""The byte-level tokenizer of ``shardwise train``'s text data (``windows.text_to_tokens``) as a Hugging Face
``tokenizer.json``, so that an exported model's directory encodes text exactly as training did.

Training reads a text file's UTF-8 bytes as ids 0-255 (one token per byte value) and has no special tokens: no
BOS, no EOS, no padding. The ``tokenizers`` equivalent is a ``ByteLevel`` pre-tokenizer (each byte becomes one of
GPT-2's 256 printable stand-in characters; ``use_regex`` off, no prefix space) in front of a BPE model whose
vocabulary maps the stand-in of byte ``b`` to id ``b`` and which has no merges, and a ``ByteLevel`` decoder. The
JSON is written here directly (it is a documented format), so exporting needs no ``tokenizers`` installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["byte_tokenizer_json", "byte_tokenizer_config", "BYTE_SPECIAL_IDS"]

BYTE_SPECIAL_IDS: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None}
"""The byte-level tokenizer has no special tokens: ``config.json``'s ids say so explicitly (otherwise
``transformers`` would fill in its architecture's defaults, e.g. Llama's eos 2, which is the byte 0x02 here)."""


def _byte_chars() -> list[str]:
    """GPT-2's ``bytes_to_unicode``: the character standing for each byte value 0-255 (printable bytes stand for
    themselves, the others are shifted above U+0100), as ``tokenizers``' ``ByteLevel`` uses it."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars: dict[int, int] = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def byte_tokenizer_json() -> dict[str, Any]:
    """The ``tokenizer.json`` object of the byte-level tokenizer (module docstring): ``encode(text).ids`` is
    ``text_to_tokens(text).tolist()`` for every string."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": dict(byte_level), "post_processor": None, "decoder": dict(byte_level),
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {c: b for b, c in enumerate(_byte_chars())}, "merges": []},
    }


def byte_tokenizer_config(model_max_length: int | None = None) -> dict[str, Any]:
    """``tokenizer_config.json`` beside it: the generic fast tokenizer (not the architecture's own class, which
    would add a BOS token the byte tokenizer does not have) and no special tokens."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                              "add_bos_token": False, "add_eos_token": False}
    if model_max_length:
        config["model_max_length"] = int(model_max_length)
    return config
