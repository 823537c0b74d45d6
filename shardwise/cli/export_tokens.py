"""What an ``--format hf`` export says about tokens: the special token ids of ``config.json`` and
``generation_config.json``, and which tokenizer files travel along.

Special ids (``bos_token_id``, ``eos_token_id``, ``pad_token_id``), first source that names one wins:

1. the source model: ``config.json`` (and ``generation_config.json``) of the run's ``model.pretrained``
   directory, or the run's ``model.hf_config`` file;
2. the prepared dataset the run trained on (``dataset.json``'s ``eos_id``: the token ending every document, so
   it is also what starts the next one; ``bos_token_id`` is ``tokenizer_config.json``'s ``bos_token`` when it
   names one, else that EOS, GPT-2's convention);
3. a byte-level run (``data.path`` empty or a text file): no special tokens, written as ``null`` so that
   ``transformers`` does not fill in its architecture's defaults.

Tokenizer files: those ``export.tokenizer_files`` finds; a byte-level run without any gets the byte-level
``tokenizer.json`` (``data.byte_tokenizer``). A ``tokenizer.json`` without a ``tokenizer_config.json`` gets one
naming the generic fast tokenizer and its EOS/BOS tokens, so ``AutoTokenizer`` adds nothing the run did not train
on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..data.byte_tokenizer import BYTE_SPECIAL_IDS, byte_tokenizer_config, byte_tokenizer_json

__all__ = ["TOKEN_KEYS", "json_object", "data_kind", "special_ids", "generation_config", "generated_tokenizer_files"]

TOKEN_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def json_object(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; {} when the file is missing, unreadable, or holds something else."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _section(state: dict[str, Any], name: str) -> dict[str, Any] | None:
    config = state.get("config")
    section = config.get(name) if isinstance(config, dict) else None
    return section if isinstance(section, dict) else None


def _prepared(state: dict[str, Any]) -> Path | None:
    data = _section(state, "data") or {}
    path = data.get("path")
    if isinstance(path, str) and path and Path(path).expanduser().is_dir():
        return Path(path).expanduser()
    return None


def data_kind(state: dict[str, Any]) -> str:
    """``prepared`` (a ``shardwise prepare`` directory), ``bytes`` (the generated corpus or a text file: the
    byte-level tokenizer) or ``unknown`` (a ``.bin`` of ids, a path gone, a checkpoint without a data config)."""
    data = _section(state, "data")
    if data is None:
        return "unknown"
    if _prepared(state) is not None:
        return "prepared"
    path, fmt = str(data.get("path") or ""), str(data.get("format") or "auto")
    if not path or fmt == "text" or (fmt == "auto" and not path.endswith(".bin") and Path(path).expanduser().is_file()):
        return "bytes"
    return "unknown"


def _source_configs(state: dict[str, Any]) -> list[Path]:
    """The source model's ``config.json``: in ``model.pretrained``, then ``model.hf_config``."""
    model = _section(state, "model") or {}
    found = []
    if isinstance(model.get("pretrained"), str) and model["pretrained"]:
        found.append(Path(model["pretrained"]).expanduser() / "config.json")
    if isinstance(model.get("hf_config"), str) and model["hf_config"]:
        found.append(Path(model["hf_config"]).expanduser())
    return [p for p in found if p.is_file()]


def _token_id(tokenizer: Path, token: Any) -> int | None:
    """The id of ``token`` (a string or ``{"content": ...}``) in a ``tokenizer.json``: its added tokens, then the
    model's vocabulary; None when it is not there."""
    token = token.get("content") if isinstance(token, dict) else token
    if not isinstance(token, str) or not token:
        return None
    raw = json_object(tokenizer)
    for added in raw.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return int(added["id"])
    vocab = (raw.get("model") or {}).get("vocab")
    value = vocab.get(token) if isinstance(vocab, dict) else None
    return value if isinstance(value, int) else None


def special_ids(state: dict[str, Any]) -> dict[str, Any]:
    """The special token ids the run's sources name (module docstring); a key is absent when nothing names it."""
    ids: dict[str, Any] = {}
    for config in _source_configs(state):
        # config.json's own ids first; a generation_config.json beside a model directory's fills the gaps
        beside = json_object(config.parent / "generation_config.json") if config.name == "config.json" else {}
        raw = {**beside, **json_object(config)}
        for key in TOKEN_KEYS:
            if key in raw:
                ids.setdefault(key, raw[key])
    kind = data_kind(state)
    prepared = _prepared(state)
    if kind == "prepared" and prepared is not None:
        eos = json_object(prepared / "dataset.json").get("eos_id")
        if isinstance(eos, int):
            ids.setdefault("eos_token_id", eos)
            bos = _token_id(prepared / "tokenizer.json", json_object(prepared / "tokenizer_config.json").get("bos_token"))
            ids.setdefault("bos_token_id", eos if bos is None else bos)
    elif kind == "bytes":
        for key, value in BYTE_SPECIAL_IDS.items():
            ids.setdefault(key, value)
    return ids


def generation_config(state: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """``generation_config.json``: the source model's own (its sampling settings kept) when it has one, with the
    special ids of ``config`` wherever it names none."""
    gen: dict[str, Any] = {}
    for source in _source_configs(state):
        if source.name == "config.json" and (source.parent / "generation_config.json").is_file():
            gen = json_object(source.parent / "generation_config.json")
            break
    for key in TOKEN_KEYS:
        if key in config and key not in gen:
            gen[key] = config[key]
    return gen


def _token_name(tokenizer: dict[str, Any], token_id: Any) -> str | None:
    for added in tokenizer.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("id") == token_id and isinstance(added.get("content"), str):
            return str(added["content"])
    vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(token_id, int):
        return next((k for k, v in vocab.items() if v == token_id), None)
    return None


def generated_tokenizer_files(state: dict[str, Any], copied: list[Path], config: dict[str, Any],
                              context: int | None) -> dict[str, Any]:
    """File name → JSON object of the tokenizer files the export writes itself (module docstring)."""
    names = {p.name for p in copied}
    out: dict[str, Any] = {}
    if "tokenizer.json" not in names and data_kind(state) == "bytes" and not names:
        out["tokenizer.json"] = byte_tokenizer_json()
        out["tokenizer_config.json"] = byte_tokenizer_config(context)
    elif "tokenizer.json" in names and "tokenizer_config.json" not in names:
        tokenizer = json_object(next(p for p in copied if p.name == "tokenizer.json"))
        tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                      "clean_up_tokenization_spaces": False}
        for key, field in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"), ("pad_token_id", "pad_token")):
            name = _token_name(tokenizer, config.get(key))
            if name is not None:
                tok_config[field] = name
        if context:
            tok_config["model_max_length"] = int(context)
        out["tokenizer_config.json"] = tok_config
    return out
