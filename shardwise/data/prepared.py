"""Reading a dataset written by ``shardwise prepare``: memory-mapped token (and mask) shards behind one index.

``open_prepared(DIR)`` checks the directory against its index ``dataset.json`` (present and readable, every shard
there with the size the index gives, a known dtype; with ``verify=True`` also every shard's sha256) and returns a
``PreparedDataset`` whose splits are ``TokenStream``s: the concatenation of a split's shards, read by token range
into int64 tensors. Nothing is read at open beyond the index and the file sizes: the shards are memory-mapped on
first use, so a dataset larger than memory costs only the pages a reader touches.

A directory without an index is refused: ``prepare`` writes the index last and publishes the directory by one
rename, so a killed prepare never leaves anything this reader accepts. docs/data.md describes the format.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["INDEX", "FORMAT", "SPLIT_RULE", "TokenStream", "PreparedSplit", "PreparedDataset", "is_prepared",
           "open_prepared"]

INDEX = "dataset.json"
FORMAT = "shardwise-prepared-v1"
SPLIT_RULE = ("by document: blake2b (8-byte digest) of the document's ordinal (8 bytes, little-endian) and its "
              "UTF-8 text (SFT: prompt, NUL, response; chat: the messages as compact JSON, keys sorted), as a "
              "number in [0, 1), below val_fraction -> val")
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4"), "uint8": np.dtype("u1")}
_AGAIN = "run shardwise prepare again"
SCAN_ALL = 1 << 25
"""A split of at most this many tokens is read whole by ``TokenStream.largest`` (64 MiB of uint16)."""
SCAN_BLOCKS, SCAN_BLOCK = 256, 1 << 16
"""A larger one: this many evenly spaced blocks of this many tokens (16M tokens)."""
_BUILDING = re.compile(r"\.(tmp|old)-\d+$")


class TokenStream:
    """A read-only concatenation of one split's memory-mapped shards (tokens, or the 0/1 mask of SFT data)."""

    def __init__(self, files: list[Path], counts: list[int], dtype: str) -> None:
        kept = [(f, n) for f, n in zip(files, counts) if n > 0]
        self.files = [f for f, _ in kept]
        self.dtype = DTYPES[dtype]
        self._offsets = [0]
        for _, n in kept:
            self._offsets.append(self._offsets[-1] + n)
        self._maps: list[np.memmap | None] = [None] * len(kept)
        self.recorded_max: int | None = None
        """The split's largest token id as ``dataset.json`` records it (``max_id``); None in an older index."""

    def __len__(self) -> int:
        """Tokens in the split."""
        return self._offsets[-1]

    def _map(self, i: int) -> np.memmap:
        m = self._maps[i]
        if m is None:
            m = self._maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r")
        return m

    def read(self, start: int, stop: int) -> torch.Tensor:
        """Tokens ``[start, stop)`` as an int64 tensor ``(stop - start,)``; the range may cross shards."""
        if not (0 <= start <= stop <= len(self)):
            raise IndexError(f"token range [{start}, {stop}) is outside [0, {len(self)}) of this split")
        out = torch.empty(stop - start, dtype=torch.int64)
        i = bisect.bisect_right(self._offsets, start) - 1
        pos = start
        while pos < stop:
            base, end = self._offsets[i], min(stop, self._offsets[i + 1])
            out[pos - start:end - start] = torch.from_numpy(self._map(i)[pos - base:end - base].astype(np.int64))
            pos, i = end, i + 1
        return out

    def largest(self) -> tuple[int, str, bool]:
        """(the largest token id seen, the shard file holding it, whether every token was read): the whole split
        when it holds at most ``SCAN_ALL`` tokens, else ``SCAN_BLOCKS`` evenly spaced blocks of ``SCAN_BLOCK``
        tokens (each cut at the end of the shard it starts in) — a bounded launch-time check of damaged shards (ids the tokenizer cannot have produced)."""
        top, where = -1, ""
        n = len(self)
        if n <= SCAN_ALL:
            for i, f in enumerate(self.files):
                m = self._map(i)
                value = int(m.max()) if len(m) else -1
                if value > top:
                    top, where = value, f.name
            return top, where, True
        for k in range(SCAN_BLOCKS):
            start = (n - SCAN_BLOCK) * k // (SCAN_BLOCKS - 1)
            i = bisect.bisect_right(self._offsets, start) - 1
            base = self._offsets[i]  # the block's part in the shard it starts in (straight from the map)
            value = int(self._map(i)[start - base:min(start + SCAN_BLOCK, self._offsets[i + 1]) - base].max())
            if value > top:
                top, where = value, self.files[i].name
        return top, where, False

    def __getstate__(self) -> dict[str, Any]:
        # a copy sent to another process (a DataLoader worker) maps the files itself, never pickles their pages
        return {**self.__dict__, "_maps": [None] * len(self._maps)}


@dataclass(frozen=True)
class PreparedSplit:
    tokens: TokenStream
    mask: TokenStream | None
    """0/1 per token, 1 = a prediction target (SFT: response tokens and the EOS); None when not SFT."""
    documents: int = 0


@dataclass(frozen=True)
class PreparedDataset:
    path: Path
    vocab_size: int
    dtype: str
    eos_id: int
    tokenizer_fingerprint: str
    """sha256 of the ``tokenizer.json`` the data was encoded with."""
    sft: bool
    tokenizer_file: Path
    train: PreparedSplit
    val: PreparedSplit | None
    index: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The whole ``dataset.json`` (inputs, split rule, fields)."""


def is_prepared(path: str | Path) -> bool:
    """A directory holding an index (not checked further: ``open_prepared`` does that)."""
    p = Path(path)
    return p.is_dir() and (p / INDEX).is_file()


def _half(path: Path, why: str) -> ValueError:
    return ValueError(f"{str(path)!r} is half-written or not a prepared dataset: {why}; {_AGAIN} (shardwise prepare "
                      f"INPUT... --tokenizer TOKENIZER --out {path})")


def _read_index(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise ValueError(f"prepared dataset {str(root)!r} does not exist; make it with shardwise prepare INPUT... "
                         f"--tokenizer TOKENIZER --out {root}")
    if _BUILDING.search(root.name):
        raise _half(root, "a directory that shardwise prepare is building or replacing (or left when it was killed)")
    if not (root / INDEX).is_file():
        raise _half(root, f"no {INDEX}")
    try:
        index = json.loads((root / INDEX).read_text())
    except (ValueError, OSError) as exc:
        raise _half(root, f"{INDEX} cannot be read as JSON ({exc})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise _half(root, f"{INDEX} has format {found!r}, not {FORMAT!r}")
    for key in ("vocab_size", "eos_id", "dtype", "splits", "tokenizer", "sft"):
        if key not in index:
            raise _half(root, f"{INDEX} has no {key!r}")
    if index["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{root / INDEX}: dtype {index['dtype']!r} is not one of ['uint16', 'uint32']; {_AGAIN}")
    if "train" not in index["splits"]:
        raise _half(root, f"{INDEX} has no train split")
    return index


def _shard_path(root: Path, name: Any, size: int, *, verify: bool, sha256: str | None) -> Path:
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise ValueError(f"{root / INDEX} names shard {name!r}, which is not a plain file name inside the dataset "
                         f"directory; {_AGAIN}")
    path = root / name
    if not path.is_file():
        raise ValueError(f"{str(root)!r}: shard {name!r} named in {INDEX} is missing; {_AGAIN} (--force), or restore "
                         f"the file")
    found = path.stat().st_size
    if found != size:
        raise ValueError(f"{str(root)!r}: shard {name!r} holds {found} bytes, but {INDEX} gives it {size}: truncated "
                         f"or from another prepare; {_AGAIN} (--force)")
    if verify and sha256 is not None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                digest.update(block)
        if digest.hexdigest() != sha256:
            raise ValueError(f"{str(root)!r}: shard {name!r} is damaged: sha256 {digest.hexdigest()[:16]}..., "
                             f"{INDEX} records {sha256[:16]}...; {_AGAIN} (--force), or restore the file")
    return path


def _split(root: Path, entry: dict[str, Any], dtype: str, sft: bool, verify: bool) -> PreparedSplit:
    itemsize = DTYPES[dtype].itemsize
    files, masks, counts = [], [], []
    for shard in entry["shards"]:
        n = int(shard["tokens"])
        files.append(_shard_path(root, shard["file"], n * itemsize, verify=verify, sha256=shard.get("sha256")))
        if sft:
            masks.append(_shard_path(root, shard.get("mask_file"), n, verify=verify, sha256=shard.get("mask_sha256")))
        counts.append(n)
    tokens = TokenStream(files, counts, dtype)
    if isinstance(entry.get("max_id"), int):
        tokens.recorded_max = int(entry["max_id"])
    if len(tokens) != int(entry["tokens"]):
        raise _half(root, f"{INDEX}: the shards hold {len(tokens)} tokens, the split says {entry['tokens']}")
    return PreparedSplit(tokens=tokens, mask=TokenStream(masks, counts, "uint8") if sft else None,
                         documents=int(entry.get("documents", 0)))


def open_prepared(path: str | Path, *, verify: bool = False) -> PreparedDataset:
    """Open and check a prepared dataset (module docstring). One-line ``ValueError`` naming the file and the fix."""
    root = Path(path)
    index = _read_index(root)
    dtype, sft = index["dtype"], bool(index["sft"])
    try:
        splits = {name: _split(root, entry, dtype, sft, verify) for name, entry in index["splits"].items()}
    except (KeyError, TypeError) as exc:
        raise _half(root, f"{INDEX} is missing shard information ({exc!r})") from None
    tokenizer_file = root / index["tokenizer"].get("file", "tokenizer.json")
    if not tokenizer_file.is_file():
        raise ValueError(f"{str(root)!r}: {tokenizer_file.name} is missing (the tokenizer the data was encoded "
                         f"with); {_AGAIN} (--force), or copy it back")
    return PreparedDataset(path=root, vocab_size=int(index["vocab_size"]), dtype=dtype, eos_id=int(index["eos_id"]),
                           tokenizer_fingerprint=str(index["tokenizer"].get("sha256", "")), sft=sft,
                           tokenizer_file=tokenizer_file, train=splits["train"], val=splits.get("val"), index=index)
