"""Integrity of sharded checkpoints: checksums, validation of ``index.json``, confined paths, finding an intact one.

Every piece entry of a ``shardwise-sharded-v2`` index carries ``"crc32"``: the CRC-32 (``zlib.crc32``) of the
tensor's raw contiguous CPU bytes — exactly the bytes safetensors stores — computed by the rank that writes
the piece. Every read (``Checkpoint.full``, so every loader and ``shardwise export``) recomputes it; v1
indexes (no checksums) still load, with every structural check but no checksum.

Why CRC-32: it detects every burst error of up to 32 bits and any accidental damage (flipped bytes, a torn
write, a truncated copy) with probability 1 - 2⁻³²; a cryptographic hash would only add protection against
deliberate forgery, which a checkpoint next to the code that trains it does not need. Measured on the
2-core development machine (best of 5, float32 from ``torch.randn``, buffer passed without a copy)::

    python - <<'PY'   # also in benchmarks/RESULTS.md, "Checkpoint checksums"
    import hashlib, time, zlib, torch
    for mib in (64, 256):
        buf = torch.randn(mib * 2**18).numpy().data
        for name, fn in [("zlib.crc32", zlib.crc32), ("hashlib.sha256", lambda b: hashlib.sha256(b).digest()),
                         ("hashlib.blake2b", lambda b: hashlib.blake2b(b).digest())]:
            best = min((lambda s: (fn(buf), time.perf_counter() - s)[1])(time.perf_counter()) for _ in range(5))
            print(f"{mib:4d} MiB {name:16s} {mib * 2**20 / best / 1e9:6.2f} GB/s")
    PY
     64 MiB  zlib.crc32 3.71 GB/s   hashlib.sha256 1.58 GB/s   hashlib.blake2b 0.82 GB/s
    256 MiB  zlib.crc32 3.62 GB/s   hashlib.sha256 1.57 GB/s   hashlib.blake2b 0.80 GB/s

CRC-32 is the fastest and needs no new dependency.

Confinement: a piece's ``file`` must be a plain ``rankNNNNN.safetensors`` name whose resolved path (symlinks
followed) lies in the checkpoint directory; ``latest`` must hold a plain ``step_NNNNNN`` name. Anything else
is a ``CheckpointError`` before a single byte outside the directory is opened.

Ranged pieces (``"range": [start, count]``: elements of the row-major flattening of the piece's block,
``sharded.BlockRangePiece``) get the same checks: the range lies inside the block, the file holds ``count``
elements, and coverage counts the range's elements (every element of the view exactly once).
"""

from __future__ import annotations

import json
import os
import math
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

__all__ = ["fsync_path", "CheckpointError", "FORMAT", "FORMATS", "tensor_crc32", "load_index", "piece_path", "check_layout",
           "read_piece", "verify_checkpoint", "checkpoints_root", "latest_checkpoint", "resolve_checkpoint",
           "latest_intact_checkpoint"]

FORMAT = "shardwise-sharded-v2"
"""Index format written now (piece entries carry ``crc32``)."""
FORMATS = ("shardwise-sharded-v1", FORMAT)
"""Index formats that load."""
CHECKPOINTS = "checkpoints"
"""Sub-directory of a run directory holding its checkpoints."""
LATEST = "latest"
"""File in the checkpoints directory naming the newest published checkpoint."""
_PIECE_FILE = re.compile(r"rank\d+\.safetensors")
_STEP_DIR = re.compile(r"step_(\d+)")
_TOP_KEYS = ("format", "step", "mesh", "world_size", "state", "tensors")
_TENSOR_KEYS = ("view_shape", "full_shape", "dtype", "sbp", "axes")
FIX = ("resume from an earlier checkpoint: `shardwise train --resume RUN_DIR` picks the newest intact one, or pass "
       "an intact checkpoint directory")
"""The remedy every damaged-checkpoint message ends with."""


class CheckpointError(ValueError):
    """A checkpoint on disk is damaged, incomplete or unsafe to read; the message (one line) names the
    checkpoint, the file, the tensor when there is one, and the fix."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _fail(ckpt: Path, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint {ckpt}: {_one_line(what)}; {FIX}")


def tensor_crc32(t: torch.Tensor) -> int:
    """CRC-32 of ``t``'s raw bytes in contiguous CPU layout (what safetensors stores)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    return zlib.crc32(flat.view(torch.uint8).numpy())


def load_index(ckpt: Path) -> dict[str, Any]:
    """``ckpt/index.json`` parsed and checked for structure and confined piece file names."""
    path = ckpt / "index.json"
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        raise _fail(ckpt, f"{path} is missing (not a checkpoint directory, or an unfinished save)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _fail(ckpt, f"{path} cannot be read as JSON ({exc})") from None
    if not isinstance(index, dict) or index.get("format") not in FORMATS:
        found = index.get("format") if isinstance(index, dict) else type(index).__name__
        raise _fail(ckpt, f"{path} has unknown format {found!r} (expected one of {list(FORMATS)})")
    missing = [k for k in _TOP_KEYS if k not in index]
    if missing or not isinstance(index["tensors"], dict):
        raise _fail(ckpt, f"{path} lacks {missing or ['a tensors mapping']}; the index is damaged")
    for key, info in index["tensors"].items():
        _check_entry(ckpt, path, key, info)
    return index


def _check_entry(ckpt: Path, path: Path, key: str, info: Any) -> None:
    lacks = [k for k in _TENSOR_KEYS if not isinstance(info, dict) or k not in info]
    if lacks:
        raise _fail(ckpt, f"{path}: tensor {key!r} lacks {lacks}; the index is damaged")
    for piece in info.get("pieces", []):
        if not isinstance(piece, dict) or "file" not in piece or "extent" not in piece:
            raise _fail(ckpt, f"{path}: a piece of {key!r} lacks 'file' or 'extent'; the index is damaged")
        piece_path(ckpt, piece["file"], key)


def piece_path(ckpt: Path, name: Any, key: str) -> Path:
    """The path of piece file ``name``, which must be a plain ``rankNNNNN.safetensors`` inside ``ckpt``."""
    plain = isinstance(name, str) and _PIECE_FILE.fullmatch(name) is not None
    path = ckpt / name if plain else None
    if path is None or path.resolve().parent != ckpt.resolve():
        raise _fail(ckpt, f"{ckpt / 'index.json'} names piece file {name!r} for {key!r}, which is not a plain "
                          f"rankNNNNN.safetensors file inside the checkpoint directory; refusing to open it (the "
                          f"index is damaged or was tampered with)")
    return path


def _shape(ckpt: Path, key: str, info: dict[str, Any], field: str) -> tuple[int, ...]:
    value = info[field]
    if not isinstance(value, list) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise _fail(ckpt, f"index.json: {field} of {key!r} is {value!r}, not a list of sizes; the index is damaged")
    return tuple(value)


def _extent(ckpt: Path, key: str, piece: dict[str, Any], view: tuple[int, ...]) -> list[tuple[int, int]]:
    ext = piece["extent"]
    ok = isinstance(ext, list) and len(ext) == len(view) and all(
        isinstance(e, list) and len(e) == 2 and all(isinstance(v, int) for v in e) and e[0] >= 0 and e[1] >= 0
        and e[0] + e[1] <= d for e, d in zip(ext, view))
    if not ok:
        raise _fail(ckpt, f"index.json: the piece of {key!r} in {piece['file']} has extent {ext!r}, which does not "
                          f"lie within the view shape {view}; the index is damaged")
    return [(s, n) for s, n in ext]


def _range(ckpt: Path, key: str, piece: dict[str, Any], extent: list[tuple[int, int]]) -> tuple[int, int] | None:
    """A ranged piece's ``(start, count)`` within its block's flattening (None: the piece is the whole block)."""
    if "range" not in piece:
        return None
    span, size = piece["range"], math.prod(n for _, n in extent)
    if not (isinstance(span, list) and len(span) == 2 and all(isinstance(v, int) and v >= 0 for v in span)
            and span[0] + span[1] <= size):
        raise _fail(ckpt, f"index.json: the piece of {key!r} in {piece['file']} has range {span!r}, which does not "
                          f"lie within its block of {size} elements (extent {extent}); the index is damaged")
    return span[0], span[1]


def _mark(seen: torch.Tensor, extent: list[tuple[int, int]], span: tuple[int, int] | None) -> None:
    """Set the elements a piece covers in the boolean ``seen`` (its block, or a range of the block's flattening)."""
    index = tuple(slice(s, s + n) for s, n in extent)
    if span is None:
        seen[index] = True
        return
    block = seen[index].reshape(-1).clone()  # a copy whatever the block's strides, written back whole
    block[span[0]:span[0] + span[1]] = True
    seen[index] = block.reshape(seen[index].shape)


def check_layout(ckpt: Path, key: str, info: dict[str, Any]) -> torch.dtype:
    """Shapes, dtype and extents of ``key`` consistent, its pieces covering the view exactly once; its dtype."""
    view, full = _shape(ckpt, key, info, "view_shape"), _shape(ckpt, key, info, "full_shape")
    dtype = getattr(torch, str(info["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise _fail(ckpt, f"index.json: {key!r} has unknown dtype {info['dtype']!r}; the index is damaged")
    if math.prod(view) != math.prod(full):
        raise _fail(ckpt, f"index.json: {key!r} has view shape {view} but full shape {full} (different element "
                          f"counts); the index is damaged")
    pieces = info.get("pieces", [])
    extents = [_extent(ckpt, key, p, view) for p in pieces]
    spans = [_range(ckpt, key, p, e) for p, e in zip(pieces, extents)]
    covered = sum(math.prod(n for _, n in e) if r is None else r[1] for e, r in zip(extents, spans))
    if covered == math.prod(view) and len(extents) > 1:  # right count: make sure no two pieces overlap
        seen = torch.zeros(view, dtype=torch.bool)
        for e, r in zip(extents, spans):
            _mark(seen, e, r)
        covered = int(seen.sum())
    if covered != math.prod(view):
        raise _fail(ckpt, f"index.json: the {len(pieces)} piece(s) of {key!r} cover {covered} of {math.prod(view)} "
                          f"elements of its view {view} (a piece is missing from the index, or two overlap)")
    return dtype


def read_piece(ckpt: Path, key: str, info: dict[str, Any], piece: dict[str, Any], handle: Any = None) -> torch.Tensor:
    """One piece of ``key``, checked against the index: file present and readable, dtype, shape, checksum.
    ``handle``: an open ``safe_open`` of the piece's file (else the file is opened here)."""
    path = piece_path(ckpt, piece["file"], key)
    if handle is None:
        if not path.is_file():
            raise _fail(ckpt, f"file {piece['file']} (holding {key!r}) is missing")
        with _open(ckpt, path) as f:
            return read_piece(ckpt, key, info, piece, f)
    if key not in handle.keys():
        raise _fail(ckpt, f"file {piece['file']} holds no tensor {key!r} although index.json lists it there")
    try:
        local = handle.get_tensor(key)
    except Exception as exc:  # safetensors' own error type: a damaged header or data region
        raise _fail(ckpt, f"file {piece['file']} is truncated or damaged: reading {key!r} failed ({exc})") from None
    _check_piece(ckpt, key, info, piece, local)
    return local


def _open(ckpt: Path, path: Path) -> Any:
    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # SafetensorError ("incomplete metadata", "header too small"), OSError
        raise _fail(ckpt, f"file {path.name} is truncated or damaged and cannot be opened ({exc})") from None


def _check_piece(ckpt: Path, key: str, info: dict[str, Any], piece: dict[str, Any], local: torch.Tensor) -> None:
    want = tuple(n for _, n in piece["extent"])
    if "range" in piece:  # a range of the block's flattening
        want = (piece["range"][1],)
    if local.numel() != math.prod(want):
        raise _fail(ckpt, f"{key!r} in {piece['file']}: index.json gives its piece the shape {want} (extent "
                          f"{piece['extent']} of view {tuple(info['view_shape'])}"
                          f"{', range ' + str(piece['range']) if 'range' in piece else ''}) but the file holds shape "
                          f"{tuple(local.shape)}; index.json and the file disagree")
    if str(local.dtype).replace("torch.", "") != info["dtype"]:
        raise _fail(ckpt, f"{key!r} in {piece['file']}: index.json says dtype {info['dtype']} but the file holds "
                          f"{str(local.dtype).replace('torch.', '')}; index.json and the file disagree")
    if "crc32" in piece:
        found = tensor_crc32(local)
        if found != piece["crc32"]:
            raise _fail(ckpt, f"file {piece['file']}, tensor {key!r}: checksum does not match (crc32 expected "
                              f"{piece['crc32']:#010x}, found {found:#010x}); the file is damaged")


def verify_checkpoint(path: str | Path) -> None:
    """Check a checkpoint directory completely from its files (no communication): the index, every piece
    file (confined, present, readable), every piece's dtype, shape and checksum, and complete coverage.
    Raises ``CheckpointError`` (one line: checkpoint, file, tensor, fix) at the first problem."""
    ckpt = Path(path)
    index = load_index(ckpt)
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for key, info in index["tensors"].items():
        check_layout(ckpt, key, info)
        for piece in info.get("pieces", []):
            by_file.setdefault(piece["file"], []).append((key, piece))
    for name, entries in sorted(by_file.items()):
        path_ = piece_path(ckpt, name, entries[0][0])
        if not path_.is_file():
            raise _fail(ckpt, f"file {name} (holding {entries[0][0]!r} and {len(entries) - 1} more) is missing")
        with _open(ckpt, path_) as f:
            for key, piece in entries:
                read_piece(ckpt, key, index["tensors"][key], piece, f)


def checkpoints_root(run_dir: str | Path) -> Path:
    """``run_dir/checkpoints`` when it exists, else ``run_dir`` (given a checkpoints directory itself)."""
    root = Path(run_dir)
    return root / CHECKPOINTS if (root / CHECKPOINTS).is_dir() else root


def _pointed(root: Path) -> Path | None:
    """The directory ``root/latest`` names (None without a ``latest``); a name that is not a plain
    ``step_NNNNNN`` inside ``root`` is a ``CheckpointError``."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if _STEP_DIR.fullmatch(name) is None or path.resolve().parent != root.resolve():
        raise CheckpointError(f"{pointer} holds {name[:80]!r}, not a plain step_NNNNNN directory name inside "
                              f"{root}; the pointer is damaged or was tampered with; {FIX}")
    return path


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to under ``run_dir`` (or ``run_dir/checkpoints``), None if there is none."""
    path = _pointed(checkpoints_root(run_dir))
    return path if path is not None and (path / "index.json").is_file() else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a run directory, a checkpoints directory or a checkpoint itself."""
    p = Path(path)
    if (p / "index.json").is_file():
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise ValueError(f"no checkpoint under {str(p)!r}: expected a run directory with checkpoints/latest, or a "
                         f"checkpoint directory holding index.json; train first or pass the right path")
    return found


def latest_intact_checkpoint(run_dir: str | Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """(the newest checkpoint under ``run_dir`` that passes ``verify_checkpoint``, or None; the (checkpoint,
    one-line reason) of each one skipped on the way). Tries the one ``latest`` points to first, then every
    other ``step_*`` directory, newest step first. Files only. Callers should print the reasons as warnings."""
    root = checkpoints_root(run_dir)
    skipped: list[tuple[Path, str]] = []
    first: Path | None = None
    try:
        first = _pointed(root)
    except CheckpointError as exc:
        skipped.append((root / LATEST, str(exc)))
    steps = sorted((int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
                   if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir())
    order = ([first] if first is not None else []) + [p for _, p in reversed(steps) if p != first]
    for ckpt in order:
        try:
            verify_checkpoint(ckpt)
            return ckpt, skipped
        except (CheckpointError, OSError) as exc:
            skipped.append((ckpt, _one_line(exc)))
    return None, skipped


def fsync_path(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk: what makes a rename durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
