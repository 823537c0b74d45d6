"""Writing a Hugging Face model directory tensor by tensor, atomically.

``write_hf_dir(tensors, config, out)`` takes an iterator of ``(name, tensor)``: each tensor is written (in row
chunks, so a transposed view costs no copy) and dropped before the next is asked for, so the writer holds at
most one tensor. Shards fill up to ``max_shard_bytes`` (a larger tensor gets a shard of its own) and are named
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``, or ``model.safetensors`` alone when
everything fits one. As a shard's header (every tensor's shape and offsets) precedes its data, the data go to a
scratch file first and are copied behind the header when the shard is full.

Atomic: everything is written into ``.NAME.tmp-PID`` beside ``out`` and fsynced, then renamed to ``out``. An
existing ``out`` (a model directory: it holds ``config.json``; or empty) is moved aside first and removed only
after the new one is in place, so ``out`` is at every moment either the old directory, absent, or the new one —
never half-written. Anything else at ``out`` is refused before anything is written.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping

import torch

from .hf_read import CONFIG, INDEX, SINGLE
from .integrity import fsync_path

__all__ = ["write_hf_dir", "check_out_dir", "DEFAULT_SHARD_BYTES", "CODES"]

DEFAULT_SHARD_BYTES = 5 * 2**30
"""``save_pretrained``'s default ``max_shard_size`` (5 GB)."""
_CHUNK = 4 * 2**20  # bytes per write of one tensor's rows, and per copy of scratch data

CODES: dict[torch.dtype, str] = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                                 torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
                                 torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


class _Shard:
    """One shard being filled: data into a scratch file, the header table in memory."""

    def __init__(self, folder: Path, number: int) -> None:
        self.scratch = folder / f".shard-{number:05d}.data"
        self.file: BinaryIO = open(self.scratch, "wb")
        self.header: dict[str, Any] = {}
        self.size = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        t = t.detach().to("cpu")
        nbytes = t.numel() * t.element_size()
        self.header[name] = {"dtype": CODES[t.dtype], "shape": list(t.shape),
                             "data_offsets": [self.size, self.size + nbytes]}
        rows = t.reshape(1) if t.dim() == 0 else t
        row_bytes = max(1, nbytes // max(1, rows.shape[0]))
        step = max(1, _CHUNK // row_bytes)
        for i in range(0, rows.shape[0], step):
            chunk = rows[i:i + step].contiguous().reshape(-1).view(torch.uint8)
            self.file.write(memoryview(chunk.numpy()))
        self.size += nbytes

    def finish(self, path: Path) -> None:
        """Header then data into ``path`` (fsynced); the scratch file is removed."""
        self.file.close()
        table = json.dumps({"__metadata__": {"format": "pt"}, **self.header}, separators=(",", ":")).encode()
        table += b" " * (-len(table) % 8)  # the data start 8-byte aligned, as safetensors writes them
        with open(path, "wb") as out, open(self.scratch, "rb") as data:
            out.write(struct.pack("<Q", len(table)) + table)
            _append(data, out)
            out.flush()
            os.fsync(out.fileno())
        self.scratch.unlink()


def _append(src: BinaryIO, dst: BinaryIO) -> None:
    """The rest of ``src`` onto ``dst``: in the kernel where it can (``copy_file_range``), else in chunks."""
    dst.flush()
    try:
        while os.copy_file_range(src.fileno(), dst.fileno(), 2**30):
            pass
    except (AttributeError, OSError):
        shutil.copyfileobj(src, dst, _CHUNK)


def check_out_dir(out: Path) -> None:
    """``ValueError`` unless ``out`` is absent, an empty directory or a model directory (it holds
    ``config.json``), i.e. something a new model directory may replace."""
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory; pass a new directory path")
    if any(out.iterdir()) and not (out / CONFIG).is_file():
        raise ValueError(f"--out {str(out)!r} is a non-empty directory without config.json, not a model directory; "
                         f"refusing to replace it: pass a new or empty directory")


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    fsync_path(path)


def _write_tensors(folder: Path, tensors: Iterable[tuple[str, torch.Tensor]], max_shard_bytes: int) -> dict[str, Any]:
    """All shards into ``folder`` under their final names; returns the index."""
    shards: list[_Shard] = []
    seen: set[str] = set()
    total = 0
    for name, t in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype not in CODES:
            raise TypeError(f"write_hf_dir: {name!r} is {type(t).__name__} {getattr(t, 'dtype', '')}, not a tensor of "
                            f"{', '.join(str(d).removeprefix('torch.') for d in CODES)}")
        if name in seen:
            raise ValueError(f"write_hf_dir: tensor {name!r} given twice")
        seen.add(name)
        nbytes = t.numel() * t.element_size()
        if not shards or (shards[-1].size and shards[-1].size + nbytes > max_shard_bytes):
            shards.append(_Shard(folder, len(shards) + 1))
        shards[-1].add(name, t)
        total += nbytes
        del t  # the caller's iterator may now free it
    if not shards:
        raise ValueError("write_hf_dir: no tensors to write")
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    weight_map: dict[str, str] = {}
    for shard, name in zip(shards, names):
        shard.finish(folder / name)
        weight_map.update({key: name for key in shard.header})
    return {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


def write_hf_dir(tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any], out: str | Path, *,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, extra_files: Iterable[str | Path] = (),
                 extra_json: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the model directory ``out``: ``config.json`` (``config``), the tensors of ``tensors`` (consumed one
    at a time) in shards of at most ``max_shard_bytes`` with their index (or one ``model.safetensors``), a
    copy of each of ``extra_files`` (tokenizer files) and each ``extra_json`` entry (file name → JSON object, e.g.
    ``generation_config.json``) — atomically (see the module docstring). Returns the index
    (``weight_map``: tensor → file; ``metadata.total_size``). ``ValueError`` for an ``out`` it may not replace
    (before anything is written), a tensor named twice or none at all; the directory is then left as it was."""
    out = Path(out).expanduser().absolute()
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes = {max_shard_bytes} must be positive")
    check_out_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        index = _write_tensors(tmp, tensors, max_shard_bytes)
        if len(set(index["weight_map"].values())) > 1:
            _write_json(tmp / INDEX, index)
        _write_json(tmp / CONFIG, config)
        for extra in extra_files:
            shutil.copyfile(extra, tmp / Path(extra).name)
            fsync_path(tmp / Path(extra).name)
        for name, value in (extra_json or {}).items():
            if Path(name).name != name or name in (CONFIG, INDEX):
                raise ValueError(f"write_hf_dir: extra_json name {name!r} must be a plain file name other than "
                                 f"{CONFIG} and {INDEX}")
            _write_json(tmp / name, value)
        fsync_path(tmp)
        _publish(tmp, out, old)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return index


def _publish(tmp: Path, out: Path, old: Path) -> None:
    """``tmp`` becomes ``out``; a previous ``out`` is moved aside first and restored if the rename fails."""
    moved = out.exists()
    if moved:
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if moved:
            os.rename(old, out)
        raise
    fsync_path(out.parent)
    if moved:
        shutil.rmtree(old, ignore_errors=True)
