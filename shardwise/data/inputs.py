"""The inputs of ``shardwise prepare``: what each path is, and the stream of chunks the encoding workers get.

Kinds: a text file (cut into documents by ``--documents``: ``text_documents``), a JSON Lines file (``.jsonl``/``.json``: one object per line), a directory
(its files, recursively, in sorted order, hidden ones skipped; each file by its own kind) and a Hugging Face
``datasets`` dataset saved with ``save_to_disk``. Everything is checked in ``discover`` before any work starts.

``chunks`` streams the inputs: the main process lists text files (the worker reads them), reads JSON Lines as raw
lines (the worker parses them) and rows of a dataset; a chunk holds at most ``CHUNK_BYTES`` of input, or one
larger document alone. Chunk
boundaries and document ordinals depend on the inputs alone, never on the number of workers, so the split of
each document and the bytes written are the same for any ``--workers``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Iterator, Literal

from .encode_worker import Chunk
from .text_documents import resolve_mode, text_documents

__all__ = ["Input", "Chunk", "discover", "chunks", "CHUNK_BYTES", "INSTALL_DATASETS"]

CHUNK_BYTES = 1 << 20
"""Input bytes per chunk (at most, unless one document is larger): small enough that 2 × workers chunks in flight bound the memory, large enough
that a worker's round trip is amortised."""
CHUNK_ITEMS = 2048
INSTALL_DATASETS = 'pip install "shardwise[datasets]"'
JSONL_SUFFIXES = (".jsonl", ".json")

Kind = Literal["text", "jsonl", "hf-dataset"]


@dataclass
class Input:
    """One INPUT argument and what it expanded to."""

    arg: str
    kind: str
    """``text``, ``jsonl``, ``hf-dataset`` or ``directory``."""
    files: list[tuple[Path, Kind]] = field(default_factory=list)
    documents: int = 0
    """Filled in while preparing: the documents (examples) kept from this input."""


def _kind_of_file(path: Path) -> Kind:
    return "jsonl" if path.suffix.lower() in JSONL_SUFFIXES else "text"


def _is_hf_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "state.json").is_file()


def _hidden(rel: Path) -> bool:
    return any(part.startswith(".") for part in rel.parts)


def _matches(rel: Path, globs: tuple[str, ...]) -> bool:
    """Whether a directory's file (its path relative to the directory) is kept: any ``--glob`` pattern matches its
    name or its relative path (``*.py``, ``src/*.txt``); no pattern keeps every file."""
    return not globs or any(fnmatch(rel.name, g) or fnmatch(rel.as_posix(), g) for g in globs)


def _expand(arg: str, *, sft: bool, globs: tuple[str, ...] = ()) -> Input:
    path = Path(arg)
    if not path.exists():
        raise ValueError(f"input {arg!r} does not exist; pass text files, .jsonl files, directories of them or a "
                         f"datasets directory (save_to_disk)")
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        raise ValueError(f"input {arg!r} is a DatasetDict saved with save_to_disk; pass one split's directory, "
                         f"e.g. {str(path / 'train')!r}")
    if path.is_dir() and _is_hf_dataset(path):
        _require_datasets(arg)
        return Input(arg, "hf-dataset", [(path, "hf-dataset")])
    if path.is_dir():
        found = sorted((p for p in path.rglob("*") if p.is_file() and not _hidden(p.relative_to(path))
                        and _matches(p.relative_to(path), globs)), key=lambda p: p.relative_to(path).as_posix())
        if not found:
            which = f" matching --glob {list(globs)}" if globs else ""
            raise ValueError(f"input directory {arg!r} holds no files{which} (hidden files are skipped); pass a "
                             f"directory of text or .jsonl files" + (", or other --glob patterns" if globs else ""))
        inp = Input(arg, "directory", [(p, _kind_of_file(p)) for p in found])
    else:
        inp = Input(arg, _kind_of_file(path), [(path, _kind_of_file(path))])
    if sft:
        text = next((p for p, k in inp.files if k == "text"), None)
        if text is not None:
            raise ValueError(f"--sft reads JSON Lines records (or a datasets directory), but {str(text)!r} is a "
                             f"text file; pass .jsonl files with prompt/response fields or messages lists, or drop --sft")
    return inp


def _require_datasets(arg: str) -> Any:
    try:
        import datasets
    except ModuleNotFoundError:
        raise ValueError(f"input {arg!r} is a Hugging Face datasets directory, which needs the datasets package; "
                         f"install it with: {INSTALL_DATASETS}") from None
    return datasets


def discover(args: list[str] | tuple[str, ...], *, sft: bool, fields: tuple[str, ...],
             globs: tuple[str, ...] = (), messages_field: str = "messages") -> list[Input]:
    """Expand and check every INPUT (existence, kinds, the fields of a dataset's columns: with ``sft`` a
    ``messages_field`` column makes a chat dataset); ``globs`` filters the files found in directories (files named
    explicitly are always read)."""
    if not args:
        raise ValueError("no INPUT given; pass text files, .jsonl files, directories or a datasets directory")
    inputs = [_expand(a, sft=sft, globs=globs) for a in args]
    for inp in inputs:
        if inp.kind == "hf-dataset":
            columns = _open_dataset(inp.arg).column_names
            if sft and messages_field in columns:
                continue
            missing = [f for f in fields if f not in columns]
            if missing:
                raise ValueError(f"dataset {inp.arg!r} has no column {missing[0]!r} (columns: {columns}); pass the "
                                 f"column that holds it with {_field_flag(missing[0], fields, sft)}")
    return inputs


def _field_flag(name: str, fields: tuple[str, ...], sft: bool) -> str:
    if not sft:
        return "--field NAME"
    return "--prompt-field NAME" if name == fields[0] else "--response-field NAME"


def _open_dataset(arg: str) -> Any:
    datasets = _require_datasets(arg)
    ds = datasets.load_from_disk(arg)
    if not isinstance(ds, datasets.Dataset):
        raise ValueError(f"input {arg!r} is not a single dataset (got {type(ds).__name__}); pass one split's "
                         f"directory")
    return ds


def chunks(inputs: list[Input], *, fields: tuple[str, ...], documents: str = "file",
           messages_field: str | None = None) -> Iterator[Chunk]:
    """Every input's documents in order, at most ``CHUNK_BYTES`` at a time or one larger document alone (streamed:
    nothing is read ahead). A worker's memory is bounded by its chunks, whatever the size of the corpus. Text files
    are cut into documents by ``documents`` (``text_documents``; ``file``: one document each). ``messages_field``
    (SFT): a dataset with that column is read as chat rows."""
    ordinal = 0
    alone = len(inputs) == 1 and inputs[0].kind == "text"  # one text file is the whole corpus: auto cuts it
    for i, inp in enumerate(inputs):
        files: list[str] = []
        size = 0
        for path, kind in inp.files:
            mode = resolve_mode(documents, path, alone=alone) if kind == "text" else ""
            if kind == "text" and mode == "file":
                n = path.stat().st_size
                if files and (size + n > CHUNK_BYTES or len(files) >= CHUNK_ITEMS):
                    yield Chunk("files", i, ordinal, files)
                    ordinal, files, size = ordinal + len(files), [], 0
                files.append(str(path))
                size += n
                continue
            if files:  # keep the order of a directory's files: flush the text files before a JSON Lines file
                yield Chunk("files", i, ordinal, files)
                ordinal, files, size = ordinal + len(files), [], 0
            if kind == "text":  # cut into documents: a chunk of texts
                made = _text_chunks(path, i, ordinal, mode)
            else:
                made = (_jsonl_chunks(path, i, ordinal) if kind == "jsonl" else
                        _dataset_chunks(path, i, ordinal, fields, messages_field))
            for chunk in made:
                ordinal += len(chunk.payload)
                yield chunk
        if files:
            yield Chunk("files", i, ordinal, files)
            ordinal += len(files)


def _text_chunks(path: Path, index: int, ordinal: int, mode: str) -> Iterator[Chunk]:
    """A text file cut into documents (``text_documents``) as chunks of texts (the worker's ``rows``)."""
    texts: list[str] = []
    size, first = 0, 1
    for line, text in text_documents(path, mode):
        if texts and (size + len(text) > CHUNK_BYTES or len(texts) >= CHUNK_ITEMS):
            yield Chunk("rows", index, ordinal, texts, str(path), first)
            ordinal, texts, size = ordinal + len(texts), [], 0
        if not texts:
            first = line
        texts.append(text)
        size += len(text)
    if texts:
        yield Chunk("rows", index, ordinal, texts, str(path), first)


def _jsonl_chunks(path: Path, index: int, ordinal: int) -> Iterator[Chunk]:
    lines: list[bytes] = []
    size, first = 0, 1
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if lines and (size + len(line) > CHUNK_BYTES or len(lines) >= CHUNK_ITEMS):
                yield Chunk("lines", index, ordinal, lines, str(path), first)
                ordinal, lines, size, first = ordinal + len(lines), [], 0, number
            lines.append(line)
            size += len(line)
    if lines:
        yield Chunk("lines", index, ordinal, lines, str(path), first)


def _dataset_chunks(path: Path, index: int, ordinal: int, fields: tuple[str, ...],
                    messages_field: str | None) -> Iterator[Chunk]:
    ds = _open_dataset(str(path))
    chat = messages_field is not None and messages_field in ds.column_names
    if chat:  # chat rows travel as {messages_field: [...]}: the worker reads them as it reads a JSON record
        fields = (messages_field,)  # type: ignore[assignment]
    ds = ds.select_columns(list(fields))
    row = 0
    rows: list[Any] = []
    size = 0
    for batch in ds.iter(batch_size=256):
        columns = [batch[f] for f in fields]
        for values in zip(*columns):
            n = sum(len(v) if isinstance(v, str) else len(str(v)) for v in values)
            if rows and (size + n > CHUNK_BYTES or len(rows) >= CHUNK_ITEMS):
                yield Chunk("rows", index, ordinal, rows, str(path), row)
                ordinal, row, rows, size = ordinal + len(rows), row + len(rows), [], 0
            rows.append({fields[0]: values[0]} if chat else values[0] if len(fields) == 1 else tuple(values))
            size += n
    if rows:
        yield Chunk("rows", index, ordinal, rows, str(path), row)
