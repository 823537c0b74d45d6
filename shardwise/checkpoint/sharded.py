"""Sharded checkpoints: every rank writes its own pieces (safetensors) plus one JSON index; any layout loads them.

On disk (``RUN/checkpoints``)::

    step_000100/index.json          every tensor: global shape, dtype, SBP, mesh, and where each piece lies
    step_000100/rank00000.safetensors   the pieces this rank owns (replicated tensors: one owner only; a
                                    pipeline rank: its own stages' tensors only)
    step_000100/rank00000.json      this rank's private state (RNG)
    latest                          the name of the newest complete checkpoint (replaced atomically)

Saving is atomic: pieces go to ``.tmp-step_000100``, files and directory are fsynced, then one ``rename``
publishes the directory and ``latest`` is swapped with ``os.replace``. A crash before the rename leaves only
a ``.tmp-*`` directory that loading ignores, so the previous checkpoint stays the loadable one.

Resharding: a tensor is described by a ``Piece`` — the global shape of its *view* (head-split QKV weights are
stored as a (3, nh·hd, ...) view so whole heads are a plain split), one SBP per mesh axis and this rank's mesh
coords. Loading rebuilds a full tensor from the index and cuts the piece the *new* layout needs, whatever
layout saved it (dp=2 → tp=2, world size 2 → 1, ...).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..comm.collectives import barrier
from ..mesh import Mesh
from ..sbp.placement import Broadcast, Partial, Placement, format_sbp, parse_sbp
from ..sbp.spec import local_extent

__all__ = ["Piece", "save_checkpoint", "Checkpoint", "latest_checkpoint", "resolve_checkpoint", "CHECKPOINTS"]

CHECKPOINTS = "checkpoints"
"""Sub-directory of a run directory holding its checkpoints."""
_LATEST = "latest"


@dataclass(frozen=True)
class Piece:
    """This rank's piece of one logical tensor: ``local`` reshaped to the view is the extent of ``coords``."""

    key: str
    local: torch.Tensor
    view_shape: tuple[int, ...]
    """Global shape of the view in which the placement is a plain split."""
    full_shape: tuple[int, ...]
    """Global shape under the plain model's key (``view_shape`` reshaped)."""
    sbp: tuple[Placement, ...]
    axes: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    coords: tuple[int, ...]

    def extent(self) -> list[tuple[int, int]]:
        return local_extent(self.view_shape, self.sbp, self.mesh_shape, self.coords)

    def owner(self) -> bool:
        """Whether this rank writes the piece: replicas (B axes) are written by coordinate 0 only."""
        return all(c == 0 for p, c in zip(self.sbp, self.coords) if isinstance(p, Broadcast))


def replicated_piece(key: str, t: torch.Tensor, mesh: Mesh) -> Piece:
    """A tensor every rank holds whole (B on every axis)."""
    shape = tuple(t.shape)
    return Piece(key, t, shape, shape, tuple(Broadcast() for _ in mesh.axes), tuple(mesh.axes), tuple(mesh.shape),
                 tuple(mesh.coord(a) for a in mesh.axes))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier_all(mesh: Mesh) -> None:
    # A barrier over each axis in turn is a barrier over the whole mesh (no world-group state needed).
    for axis in mesh.axes:
        barrier(mesh, axis)


def save_checkpoint(ckpt_root: str | Path, step: int, pieces: Sequence[Piece], *, mesh: Mesh,
                    state: dict[str, Any], rank_state: dict[str, Any], keep: int = 2,
                    crash_before_rename: bool = False) -> Path:
    """Write ``step``'s checkpoint atomically and point ``latest`` at it; returns its directory.

    ``state``: JSON-able training state (taken from rank 0); ``rank_state``: this rank's private JSON-able
    state. Collective over every axis of ``mesh``: every rank must call it with its own pieces.
    ``crash_before_rename`` (fault injection for tests) raises after all shards are durable.
    """
    root = Path(ckpt_root)
    name = f"step_{step:06d}"
    tmp, final = root / f".tmp-{name}", root / name
    if mesh.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left over from a crashed save of this step
        tmp.mkdir()
    _barrier_all(mesh)
    _write_rank_files(tmp, pieces, mesh.rank, rank_state)
    _barrier_all(mesh)
    if mesh.rank == 0:
        _write_index(tmp, step, mesh, state)
        if crash_before_rename:
            raise RuntimeError(f"debug.crash_in_save={step}: injected crash after writing the shards of step {step}, "
                               f"before publishing them")
        if final.exists():  # re-saving a step (e.g. resumed at it): move the old one out of the way first
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync(root)
        pointer = root / f".{_LATEST}.tmp"
        pointer.write_text(name + "\n")
        _fsync(pointer)
        os.replace(pointer, root / _LATEST)
        _fsync(root)
        _prune(root, keep)
    _barrier_all(mesh)
    return final


def _write_rank_files(tmp: Path, pieces: Sequence[Piece], rank: int, rank_state: dict[str, Any]) -> None:
    tensors: dict[str, torch.Tensor] = {}
    entries: list[dict[str, Any]] = []
    for p in pieces:
        if any(isinstance(s, Partial) for s in p.sbp):
            raise ValueError(f"{p.key}: a Partial (P) tensor cannot be checkpointed as is; reduce it to B or S first")
        # "axes": the mesh axes the SBP refers to — all of them, except for a pipeline stage's tensor, which
        # is described without the pp axis (only the owning pp coordinate holds it: pipeline_layout.py)
        entry = {"key": p.key, "view_shape": list(p.view_shape), "full_shape": list(p.full_shape),
                 "dtype": str(p.local.dtype).replace("torch.", ""), "sbp": format_sbp(p.sbp), "axes": list(p.axes)}
        if p.owner():
            tensors[p.key] = p.local.detach().to("cpu").contiguous()
            entry["piece"] = {"file": f"rank{rank:05d}.safetensors", "extent": p.extent()}
        entries.append(entry)
    data = tmp / f"rank{rank:05d}.safetensors"
    save_file(tensors, str(data))
    meta = tmp / f"rank{rank:05d}.json"
    meta.write_text(json.dumps({"entries": entries, "state": rank_state}))
    for path in (data, meta):
        _fsync(path)


def _write_index(tmp: Path, step: int, mesh: Mesh, state: dict[str, Any]) -> None:
    tensors: dict[str, dict[str, Any]] = {}
    for r in range(mesh.world_size):
        for e in json.loads((tmp / f"rank{r:05d}.json").read_text())["entries"]:
            info = tensors.setdefault(e["key"], {k: e[k] for k in ("view_shape", "full_shape", "dtype", "sbp", "axes")})
            if "piece" in e:
                info.setdefault("pieces", []).append(e["piece"])
    index = {"format": "shardwise-sharded-v1", "step": step, "mesh": dict(zip(mesh.axes, mesh.shape)),
             "world_size": mesh.world_size, "state": state, "tensors": tensors}
    path = tmp / "index.json"
    path.write_text(json.dumps(index, indent=1))
    _fsync(path)
    _fsync(tmp)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The checkpoint ``latest`` points to under ``run_dir`` (or ``run_dir/checkpoints``), None if there is none."""
    root = Path(run_dir)
    if (root / CHECKPOINTS).is_dir():
        root = root / CHECKPOINTS
    pointer = root / _LATEST
    if not pointer.is_file():
        return None
    path = root / pointer.read_text().strip()
    return path if (path / "index.json").is_file() else None


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


class Checkpoint:
    """A saved checkpoint opened for reading (any rank, any layout; reads files only, never communicates)."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve_checkpoint(path)
        self.index = json.loads((self.path / "index.json").read_text())
        self.step: int = self.index["step"]
        self.state: dict[str, Any] = self.index["state"]

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.index["tensors"] if k.startswith(prefix)]

    def rank_state(self, rank: int) -> dict[str, Any] | None:
        path = self.path / f"rank{rank:05d}.json"
        return json.loads(path.read_text())["state"] if path.is_file() else None

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor under its plain-model shape, assembled from every piece."""
        info = self._info(key)
        view = torch.empty(info["view_shape"], dtype=getattr(torch, info["dtype"]))
        covered = 0
        for piece in info.get("pieces", []):
            with safe_open(str(self.path / piece["file"]), framework="pt") as f:
                local = f.get_tensor(key)
            index = tuple(slice(s, s + n) for s, n in piece["extent"])
            view[index] = local.reshape(view[index].shape)
            covered += local.numel()
        if covered != view.numel():
            raise ValueError(f"checkpoint {self.path}: pieces of {key!r} cover {covered} of {view.numel()} elements; "
                             f"the checkpoint is incomplete (a rank's file is missing?)")
        return view.reshape(info["full_shape"])

    def load_piece(self, target: Piece) -> torch.Tensor:
        """The values for ``target`` (a piece of the *new* layout): full tensor → view → this rank's extent."""
        info = self._info(target.key)
        if tuple(info["full_shape"]) != target.full_shape:
            raise ValueError(f"checkpoint {self.path}: {target.key!r} has shape {tuple(info['full_shape'])} but the "
                             f"model expects {target.full_shape}; load it into a model of the saved configuration")
        view = self.full(target.key).reshape(target.view_shape)
        index = tuple(slice(s, s + n) for s, n in target.extent())
        return view[index].reshape(target.local.shape)

    def sbp(self, key: str) -> tuple[Placement, ...]:
        return tuple(parse_sbp(self._info(key)["sbp"]))

    def _info(self, key: str) -> dict[str, Any]:
        try:
            return self.index["tensors"][key]
        except KeyError:
            raise ValueError(f"checkpoint {self.path} has no tensor {key!r}; it holds "
                             f"{sorted(self.index['tensors'])[:8]}...") from None



