"""Reading a Hugging Face model directory: validate it from its headers, then read any block of any tensor.

A model directory holds ``config.json`` and its weights as safetensors: one ``model.safetensors``, or shards
``model-0000k-of-0000n.safetensors`` named by ``model.safetensors.index.json`` (``weight_map``: tensor → file).
``open_pretrained`` checks all of it before any value is read — config present and a JSON object, a weights file,
every file the index names present, every shard complete (its size equals what its header's data offsets say:
a truncated download is caught here, not in the middle of a job), every indexed tensor in its file — and knows
every tensor's file, shape and dtype from the headers alone.

``SafetensorsSource`` (the meta-tensor ``Source`` of ``shardwise.parallel.common.materialize``) reads one block
of one tensor with ``safe_open(...).get_slice(key)[index]``: only the bytes of that block are read, whatever
the rank's share is (tensor-parallel rows or columns, a ZeRO flat range: the rows covering it). The file's
float dtype (F32, F16, BF16, F64) is cast to the target dtype exactly as ``.to(dtype)`` of the whole tensor
would; other dtypes (quantised integer or float8 files) are refused. Every read is counted in the directory's
``bytes_read`` (in file bytes), so a test can assert that a rank read its share and no more.

Every failure is one ``ValueError`` line naming the file and the tensor. Local: nothing here communicates.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from ..parallel.common.materialize import flat_from_rows

__all__ = ["PretrainedDir", "TensorInfo", "SafetensorsSource", "open_pretrained", "read_header", "FILE_DTYPES",
           "SINGLE", "INDEX", "CONFIG"]

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

FILE_DTYPES: dict[str, torch.dtype] = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                                       "F64": torch.float64}
"""The file dtypes a parameter can be read from (cast to the parameter's dtype)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a model directory, from its file's header."""

    file: str
    """The file's name inside the directory."""
    shape: tuple[int, ...]
    dtype: str
    """The safetensors dtype code (``F32``, ``BF16``, ...)."""
    offset: int = -1
    """Byte offset of the tensor's data in its file (-1: unknown)."""

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * _itemsize(self.dtype)


_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _itemsize(code: str) -> int:
    return _ITEMSIZE.get(code, 1)


class PretrainedDir:
    """A validated model directory (``open_pretrained``): ``config`` (the parsed ``config.json``), ``tensors``
    (key → ``TensorInfo``), ``bytes_read`` (file bytes read by its sources so far)."""

    def __init__(self, path: Path, config: dict[str, Any], tensors: dict[str, TensorInfo], weights: str) -> None:
        self.path, self.config, self.tensors, self.weights = path, config, tensors, weights
        self.bytes_read = 0

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG

    def file_of(self, key: str) -> Path:
        return self.path / self.tensors[key].file

    def where(self, key: str | None = None) -> str:
        """For messages: the file holding ``key``, else the file that lists the tensors."""
        return str(self.file_of(key)) if key in self.tensors else str(self.path / self.weights)

    def source(self, key: str, dtype: torch.dtype = torch.float32, *, transpose: bool = False) -> "SafetensorsSource":
        return SafetensorsSource(self, key, dtype, transpose=transpose)

    def __repr__(self) -> str:
        return f"PretrainedDir({str(self.path)!r}, {len(self.tensors)} tensors in {self.weights})"


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header; ``ValueError`` for a file that is not safetensors,
    is truncated or has bytes past its last tensor, or that ``safe_open`` refuses."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            raw = f.read(n) if 0 <= n <= size - 8 else b""
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None
    if n < 0 or n > size - 8:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, shorter than its header); the download "
                         f"or copy was cut short: fetch the file again")
    try:
        header = json.loads(raw)
        entries = {k: v for k, v in header.items() if k != "__metadata__"}
        end = max((int(v["data_offsets"][1]) for v in entries.values()), default=0)
        infos = {k: TensorInfo(path.name, tuple(int(s) for s in v["shape"]), str(v["dtype"]),
                               8 + n + int(v["data_offsets"][0])) for k, v in entries.items()}
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ValueError(f"{path}: not a safetensors file (its header is not the JSON table of tensors); pass a "
                         f"directory saved with save_pretrained(safe_serialization=True)") from None
    if size < 8 + n + end:
        raise ValueError(f"{path}: truncated safetensors file: its header describes {8 + n + end} bytes, the file "
                         f"holds {size}; the download or copy was cut short: fetch the file again")
    if size > 8 + n + end:
        raise ValueError(f"{path}: {size - 8 - n - end} bytes past the last tensor its header describes; the file is "
                         f"damaged: fetch it again")
    try:
        with safe_open(str(path), framework="pt"):
            pass
    except SafetensorError as exc:
        raise ValueError(f"{path}: refused by safetensors ({' '.join(str(exc).split())}); fetch the file again") from None
    return infos


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror or exc}); check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        line = f" (line {exc.lineno}: {exc.msg})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ValueError(f"{path}: not valid JSON{line}; {what}") from None


def open_pretrained(directory: str | Path) -> PretrainedDir:
    """Validate the Hugging Face model directory ``directory`` (see the module docstring) from its headers; no
    tensor data is read. ``ValueError`` (one line naming the file, and the tensor where one is at fault)."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise ValueError(f"{str(directory)!r} is not a directory; pass a Hugging Face model directory (config.json "
                         f"plus model.safetensors or its shards)")
    if not (path / CONFIG).is_file():
        raise ValueError(f"{path / CONFIG}: missing; a Hugging Face model directory holds config.json next to its "
                         f"weights (save_pretrained writes both)")
    config = _read_json(path / CONFIG, "pass the config.json that save_pretrained wrote")
    if not isinstance(config, dict):
        raise ValueError(f"{path / CONFIG}: holds a JSON {type(config).__name__}, not an object of config fields")
    if (path / SINGLE).is_file():
        return PretrainedDir(path, config, read_header(path / SINGLE), SINGLE)
    if (path / INDEX).is_file():
        return PretrainedDir(path, config, _sharded(path), INDEX)
    other = sorted(p.name for p in path.glob("*.bin")) or sorted(p.name for p in path.glob("*.safetensors"))
    hint = (f"; it holds {other[0]}: " + ("pickled PyTorch weights are not read, re-save with "
            "save_pretrained(safe_serialization=True)" if other[0].endswith(".bin") else
            f"name it {SINGLE}, or add its {INDEX}")) if other else ""
    raise ValueError(f"{path}: no weights file ({SINGLE}, or {INDEX} with its shards){hint}")


def _sharded(path: Path) -> dict[str, TensorInfo]:
    index_path = path / INDEX
    index = _read_json(index_path, "pass the index that save_pretrained wrote")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: no 'weight_map' object (tensor name → shard file); pass the index that "
                         f"save_pretrained wrote")
    headers: dict[str, dict[str, TensorInfo]] = {}
    out: dict[str, TensorInfo] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str) or Path(name).name != name or name in (".", ".."):
            raise ValueError(f"{index_path}: tensor {key!r} is mapped to {name!r}, not a file name in the directory")
        if name not in headers:
            if not (path / name).is_file():
                raise ValueError(f"{index_path}: names {name!r} (for tensor {key!r}), which is missing from {path}; "
                                 f"the download is incomplete: fetch that shard")
            headers[name] = read_header(path / name)
        if key not in headers[name]:
            raise ValueError(f"{path / name}: holds no tensor {key!r}, which {INDEX} places there; the index and the "
                             f"shards do not belong together: fetch them again")
        out[key] = headers[name][key]
    return out


_TORCH_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def _row_range(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(first, stop)`` when ``index`` selects whole rows ``[first, stop)`` of a tensor of ``shape`` (≥ 1-D)."""
    if not shape or any(s != slice(None) for s in index[1:]):
        return None
    first, stop, step = (index[0] if index else slice(None)).indices(shape[0])
    return (first, max(first, stop)) if step == 1 else None


def _read_rows(path: Path, info: TensorInfo, first: int, stop: int) -> torch.Tensor:
    """Rows ``[first, stop)`` of ``info``'s tensor, read from ``path`` with one positioned read (little-endian,
    as safetensors stores them)."""
    row = _itemsize(info.dtype)
    for s in info.shape[1:]:
        row *= s
    buf = bytearray((stop - first) * row)
    with open(path, "rb", buffering=0) as f:
        f.seek(info.offset + first * row)
        got = f.readinto(buf)
    if got != len(buf):
        raise OSError(f"short read: {got} of {len(buf)} bytes")
    if not buf:
        return torch.empty((0, *info.shape[1:]), dtype=_TORCH_DTYPES[info.dtype])
    return torch.frombuffer(buf, dtype=_TORCH_DTYPES[info.dtype]).view(stop - first, *info.shape[1:])


class SafetensorsSource:
    """The values of tensor ``key`` of a ``PretrainedDir`` as a meta-tensor source of ``dtype`` (see the module
    docstring). ``transpose=True`` presents a 2-D (in, out) file tensor as (out, in) (GPT-2's Conv1D weights for a
    ``Linear``); a block of the view reads only the matching block of the file."""

    def __init__(self, pretrained: PretrainedDir, key: str, dtype: torch.dtype = torch.float32, *,
                 transpose: bool = False) -> None:
        info = pretrained.tensors.get(key)
        if info is None:
            raise ValueError(f"{pretrained.where()}: no tensor {key!r}")
        if info.dtype not in FILE_DTYPES:
            raise ValueError(f"{pretrained.file_of(key)}: tensor {key!r} is stored as {info.dtype}, which is not read "
                             f"(supported: {', '.join(FILE_DTYPES)}); a quantised checkpoint must be dequantised first")
        if transpose and len(info.shape) != 2:
            raise ValueError(f"{pretrained.file_of(key)}: tensor {key!r} of shape {info.shape} cannot be read "
                             f"transposed; only 2-D weights are")
        self.pretrained, self.key, self.dtype, self.transpose = pretrained, key, dtype, transpose
        self.shape: tuple[int, ...] = tuple(reversed(info.shape)) if transpose else info.shape

    def _file_block(self, index: tuple[slice, ...]) -> torch.Tensor:
        """``file_tensor[index]``, reading only those bytes: a range of rows (contiguous in the file) by one plain
        sequential read — a cold file at the disk's rate, where page faults on a memory map are several times
        slower —, anything else through ``safe_open(...).get_slice``."""
        path = self.pretrained.file_of(self.key)
        info = self.pretrained.tensors[self.key]
        rows = _row_range(index, info.shape)
        try:
            if rows is not None and info.offset >= 0 and info.dtype in _TORCH_DTYPES:
                block = _read_rows(path, info, *rows)
            else:
                with safe_open(str(path), framework="pt") as f:
                    block = f.get_slice(self.key)[index] if index and self.shape else f.get_tensor(self.key)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path}: tensor {self.key!r} cannot be read ({' '.join(str(exc).split())})") from None
        self.pretrained.bytes_read += block.numel() * block.element_size()
        return block

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``full[index]`` (``index`` over leading dims of ``shape``) as a contiguous CPU tensor of ``dtype``."""
        index = tuple(index or ())
        if len(index) > len(self.shape):
            raise ValueError(f"index {index} has more dims than {self.key!r} of shape {self.shape}")
        if self.transpose:
            rows = index[0] if index else slice(None)
            cols = index[1] if len(index) > 1 else slice(None)
            block = self._file_block((cols, rows)).t()
        else:
            block = self._file_block(index)
        return block.to(self.dtype).contiguous()

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened value: reads the rows covering them only, then cuts."""
        if not self.shape:
            return self.read().reshape(1)[start:stop]
        return flat_from_rows(lambda a, b: self.read((slice(a, b),)), self.shape, start, stop)

    def __repr__(self) -> str:
        t = ", transpose=True" if self.transpose else ""
        return f"SafetensorsSource({self.key!r} in {self.pretrained.tensors[self.key].file}{t})"
