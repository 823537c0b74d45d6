"""The tokenizer ``shardwise generate`` encodes the prompt with and decodes the tokens with, and its EOS ids.

Lookup for a run or a checkpoint (its saved config), first hit wins:

1. ``tokenizer.json`` in the prepared dataset directory (``data.path`` a directory, written by ``shardwise
   prepare``), then in the run directory;
2. the byte tokenizer when the run trained on bytes (``data.path`` empty — the generated corpus — or a text
   file): ``text_to_tokens`` / ``tokens_to_text``, ids 0-255, no EOS;
3. ``tokenizer.json`` in the run's ``model.pretrained`` directory, then beside its ``model.hf_config``;
4. otherwise (a ``.bin`` of token ids, a prepared directory without its tokenizer) a one-line error.

A Hugging Face directory uses its own ``tokenizer.json``. EOS ids come from the tokenizer's directory:
``eos_token_id`` of ``generation_config.json`` or ``config.json`` (what ``transformers``' ``generate`` stops at),
else ``tokenizer_config.json``'s ``eos_token``, else ``dataset.json``'s ``eos_id``/``eos_token_id``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .export import prepared_dir
from .export_tokens import json_object
from .generate_load import Source, UsageError

__all__ = ["Codec", "byte_codec", "find_codec", "TOKENIZER"]

TOKENIZER = "tokenizer.json"


@dataclass
class Codec:
    """Text ↔ token ids, and the ids that end a generation."""

    name: str
    """``bytes`` or the path of the ``tokenizer.json``."""
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos: list[int]


def byte_codec() -> Codec:
    """The byte tokenizer of ``shardwise train``'s text data (UTF-8 bytes as ids 0-255)."""
    from ..data.windows import text_to_tokens, tokens_to_text

    return Codec("bytes", lambda text: text_to_tokens(text).to(torch.int64).tolist(),
                 lambda ids: tokens_to_text(torch.tensor(ids, dtype=torch.int64)), [])


def _eos(place: Path, token_to_id: Callable[[str], int | None]) -> list[int]:
    """EOS ids from the files beside a tokenizer (module docstring); [] when none says."""
    for name in ("generation_config.json", "config.json"):
        raw = json_object(place / name)
        if "eos_token_id" in raw:
            value = raw["eos_token_id"]
            ids = value if isinstance(value, list) else [value]
            return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]
    token = json_object(place / "tokenizer_config.json").get("eos_token")
    token = token.get("content") if isinstance(token, dict) else token
    if isinstance(token, str) and token_to_id(token) is not None:
        return [int(token_to_id(token))]  # type: ignore[arg-type]
    data = json_object(place / "dataset.json")
    for key in ("eos_id", "eos_token_id"):
        if isinstance(data.get(key), int):
            return [data[key]]
    return []


def _load(path: Path) -> Codec:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError(f"reading the tokenizer {path} needs the tokenizers package; install it with "
                         f'pip install "shardwise[data]"') from None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust side raises plain Exception subclasses
        detail = " ".join(str(exc).split())[:200]
        raise UsageError(f"{path} cannot be read as a tokenizers tokenizer.json ({detail}); copy the model's own "
                         f"tokenizer.json there") from None
    return Codec(str(path), lambda text: tok.encode(text).ids,
                 lambda ids: tok.decode(ids, skip_special_tokens=True), _eos(path.parent, tok.token_to_id))


def _first(places: list[Path]) -> Codec | None:
    for place in places:
        if (place / TOKENIZER).is_file():
            return _load(place / TOKENIZER)
    return None


def _model_places(state: dict[str, Any]) -> list[Path]:
    config = state.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    places = []
    for name, parent in (("pretrained", False), ("hf_config", True)):
        value = model.get(name) if isinstance(model, dict) else None
        if isinstance(value, str) and value:
            places.append(Path(value).expanduser().parent if parent else Path(value).expanduser())
    return places


def find_codec(src: Source) -> Codec:
    """The tokenizer of ``src`` (module docstring); ``UsageError`` when there is none to be found."""
    if src.kind == "hf":
        found = _first([src.path])
        if found is None:
            raise UsageError(f"{src.path} holds no {TOKENIZER}; copy the model's tokenizer.json into it (the "
                             f"tokenizers package reads that file; vocab.json/merges.txt alone are not read)")
        return found
    config = src.state.get("config")
    data = config.get("data", {}) if isinstance(config, dict) else {}
    path, fmt = str(data.get("path", "")), str(data.get("format", "auto"))
    prepared = prepared_dir(src.state)
    places = [p for p in (prepared, src.run) if p is not None]
    found = _first(places)
    if found is not None:
        return found
    text_file = fmt == "text" or (fmt == "auto" and Path(path).is_file() and not path.endswith(".bin"))
    if not path or (prepared is None and text_file):
        return byte_codec()
    places += _model_places(src.state)
    found = _first(places)
    if found is not None:
        return found
    where = ", ".join(str(p) for p in places) or "nowhere (a bare checkpoint)"
    run = src.run or src.path
    raise UsageError(f"data.path {path!r} holds token ids of a tokenizer this run does not name, and no "
                     f"{TOKENIZER} was found (looked in {where}); copy the tokenizer's {TOKENIZER} into the run "
                     f"directory {run}")
