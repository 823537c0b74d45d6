"""How ``shardwise prepare`` cuts a text file into documents (``--documents MODE``).

A document is what gets an EOS after it and what the validation split draws (``--val-fraction``), so one large
text file read as one document can never be split. Modes:

* ``file``: the whole file is one document;
* ``blank-lines``: paragraphs — runs of lines separated by one or more blank (whitespace-only) lines;
* ``lines``: every non-blank line is a document;
* ``separator:STR``: the text between occurrences of ``STR`` (``\\n`` and ``\\t`` in ``STR`` mean newline and
  tab), e.g. ``separator:<|endoftext|>``;
* ``auto`` (default): when the only INPUT is one text file (a corpus in one file), it is cut at blank lines when
  it has a blank line between two non-blank ones, else at line ends; otherwise (several files, a directory)
  every text file is one document (source files, books...).

The pieces are stripped of the line ends around them; blank pieces are dropped. Files are read in a stream (a
separator piece or paragraph is held whole, never the file), and each piece is decoded as UTF-8 on its own, so a
file that is not UTF-8 is refused naming the line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

__all__ = ["DOCUMENT_MODES", "check_mode", "resolve_mode", "text_documents"]

DOCUMENT_MODES = ("auto", "file", "blank-lines", "lines", "separator:STR")
_BLOCK = 1 << 20


def check_mode(mode: str) -> None:
    """One-line ``ValueError`` unless ``mode`` is one of ``DOCUMENT_MODES`` (a separator non-empty)."""
    if mode in DOCUMENT_MODES[:4] or (mode.startswith("separator:") and len(mode) > len("separator:")):
        return
    raise ValueError(f"--documents {mode!r} is not a way to cut text files into documents; use one of "
                     f"{', '.join(DOCUMENT_MODES)} (e.g. --documents lines, --documents 'separator:<|endoftext|>')")


def _blank(line: bytes) -> bool:
    return not line.strip()


def _shape(path: Path) -> str:
    """``paragraphs`` when a blank line stands between two non-blank lines (read until the first such line),
    else ``lines``, or ``blank`` for a file without any non-blank line."""
    content = gap = False
    with open(path, "rb") as f:
        for line in f:
            if _blank(line):
                gap = content
            elif gap:
                return "paragraphs"
            else:
                content = True
    return "lines" if content else "blank"


def resolve_mode(mode: str, path: Path, *, alone: bool) -> str:
    """``mode`` with ``auto`` decided for ``path``, ``alone`` when it is the only INPUT (module docstring)."""
    if mode != "auto":
        return mode
    if not alone:
        return "file"
    shape = _shape(path)  # a blank file stays one (empty, skipped and counted) document
    return {"paragraphs": "blank-lines", "lines": "lines", "blank": "file"}[shape]


def _decode(raw: bytes, path: Path, line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{str(path)!r} line {line}: not UTF-8 text ({exc.reason}); convert the file to UTF-8 or "
                         f"leave it out of the inputs") from None


def _lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not _blank(line):
                yield number, line.rstrip(b"\r\n")


def _paragraphs(path: Path) -> Iterator[tuple[int, bytes]]:
    held: list[bytes] = []
    first = 1
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if _blank(line):
                if held:
                    yield first, b"".join(held).rstrip(b"\r\n")
                held = []
                continue
            if not held:
                first = number
            held.append(line)
    if held:
        yield first, b"".join(held).rstrip(b"\r\n")


def _separated(path: Path, separator: bytes) -> Iterator[tuple[int, bytes]]:
    held, line = b"", 1
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(_BLOCK), b""):
            held += block
            *pieces, held = held.split(separator)
            for piece in pieces:
                yield line, piece
                line += piece.count(b"\n") + separator.count(b"\n")
    yield line, held


def text_documents(path: Path, mode: str) -> Iterator[tuple[int, str]]:
    """(line where it starts, text) of every non-blank document of the text file ``path`` cut by ``mode`` (not
    ``auto``: ``resolve_mode`` first)."""
    if mode == "file":
        raw = path.read_bytes()
        pieces: Iterator[tuple[int, bytes]] = iter([(1, raw)])
    elif mode == "lines":
        pieces = _lines(path)
    elif mode == "blank-lines":
        pieces = _paragraphs(path)
    else:
        separator = mode.removeprefix("separator:").replace("\\n", "\n").replace("\\t", "\t")
        pieces = _separated(path, separator.encode("utf-8"))
    for line, raw in pieces:
        if not _blank(raw):
            yield line, _decode(raw.strip(b"\r\n") if mode != "file" else raw, path, line)
