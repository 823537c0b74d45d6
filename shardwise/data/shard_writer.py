"""Writing a prepared dataset: token (and mask) shards with their checksums, the index, and the atomic publish.

Everything is written into a temporary sibling ``OUT.tmp-<pid>``; the index ``dataset.json`` is written last,
every file and the directory are fsynced, and only then is the directory renamed to ``OUT`` (an existing ``OUT``
with ``--force``: renamed aside to ``OUT.old-<pid>``, the new one renamed in, the old one deleted). A prepare
that is killed leaves at most the temporary directory, which the reader refuses by its name (and which it
holds no index in before the very end); the next prepare into the same ``OUT`` removes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ShardWriter", "fsync_dir", "write_json_synced", "temp_dir_for", "publish",
           "remove_stale_temps", "TEMP_NAME"]

TEMP_NAME = re.compile(r"\.(tmp|old)-(\d+)$")
"""The suffix of a directory being built (``.tmp-PID``) or being replaced (``.old-PID``)."""


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (renames, new files); a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _Shard:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = open(path, "wb")
        self.digest = hashlib.sha256()
        self.count = 0

    def write(self, data: np.ndarray) -> None:
        view = memoryview(np.ascontiguousarray(data)).cast("B")
        self.file.write(view)
        self.digest.update(view)
        self.count += len(data)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


class ShardWriter:
    """One split's shards: ``SPLIT-00000.bin`` (raw little-endian tokens of ``dtype``), at most ``cap`` tokens each,
    and with ``masked`` the aligned ``SPLIT-00000.mask`` (uint8, one byte per token). A document may continue in
    the next shard: the reader concatenates them."""

    def __init__(self, root: Path, split: str, dtype: str, cap: int, *, masked: bool) -> None:
        self.root, self.split, self.cap, self.masked = root, split, cap, masked
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.done: list[dict[str, Any]] = []
        self.tokens = 0
        self.max_id = -1
        """The largest token id written (-1: none): the index records it, the launch checks it (``sources``)."""
        self._tok: _Shard | None = None
        self._mask: _Shard | None = None

    def write(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        """Append packed tokens ``(n,)`` and, for a masked split, their mask ``(n,)``."""
        tokens = tokens.astype(self.dtype, copy=False)
        if len(tokens):
            self.max_id = max(self.max_id, int(tokens.max()))
        start = 0
        while start < len(tokens):
            if self._tok is None:
                self._open()
            assert self._tok is not None
            take = min(len(tokens) - start, self.cap - self._tok.count)
            self._tok.write(tokens[start:start + take])
            if self._mask is not None:
                self._mask.write(mask[start:start + take])  # type: ignore[index]
            start += take
            self.tokens += take
            if self._tok.count == self.cap:
                self._finish()

    def _open(self) -> None:
        n = len(self.done)
        self._tok = _Shard(self.root / f"{self.split}-{n:05d}.bin")
        if self.masked:
            self._mask = _Shard(self.root / f"{self.split}-{n:05d}.mask")

    def _finish(self) -> None:
        assert self._tok is not None
        self._tok.close()
        entry: dict[str, Any] = {"file": self._tok.path.name, "tokens": self._tok.count,
                                 "sha256": self._tok.digest.hexdigest()}
        if self._mask is not None:
            self._mask.close()
            entry.update(mask_file=self._mask.path.name, mask_sha256=self._mask.digest.hexdigest())
        self.done.append(entry)
        self._tok = self._mask = None

    def close(self) -> list[dict[str, Any]]:
        """Finish the open shard; the shard entries of the index."""
        if self._tok is not None and self._tok.count:
            self._finish()
        elif self._tok is not None:  # opened but never written: no empty shard files
            for s in (self._tok, self._mask):
                if s is not None:
                    s.file.close()
                    s.path.unlink()
            self._tok = self._mask = None
        return self.done


def write_json_synced(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def temp_dir_for(out: Path) -> Path:
    return out.parent / f"{out.name}.tmp-{os.getpid()}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # it exists, under another user
    return True


def remove_stale_temps(out: Path) -> list[Path]:
    """Delete ``OUT.tmp-PID`` / ``OUT.old-PID`` siblings left by a prepare that was killed (its PID is gone)."""
    removed = []
    if not out.parent.is_dir():
        return removed
    for p in out.parent.iterdir():
        m = TEMP_NAME.search(p.name)
        if m and p.name[:m.start()] == out.name and p.is_dir() and not _alive(int(m[2])):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def publish(tmp: Path, out: Path, *, force: bool) -> None:
    """Move the finished ``tmp`` to ``out`` atomically (see the module docstring)."""
    fsync_dir(tmp)
    if out.exists():
        if not force:  # checked before any work too; someone created it meanwhile
            raise ValueError(f"--out {str(out)!r} already exists; pass --force to replace it, or another directory")
        old = out.parent / f"{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        fsync_dir(out.parent)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    else:
        os.rename(tmp, out)
    fsync_dir(out.parent)
