"""Sharded checkpoints: every rank writes its own pieces (safetensors) plus one JSON index; any layout loads them.

On disk (``RUN/checkpoints``)::

    step_000100/index.json          every tensor: global shape, dtype, SBP, mesh, where each piece lies and its CRC-32
    step_000100/rank00000.safetensors   the pieces this rank owns (replicated tensors: one owner only; a
                                    pipeline rank: its own stages' tensors only)
    step_000100/rank00000.json      this rank's private state (RNG)
    latest                          the name of the newest complete checkpoint (replaced atomically)

Saving is atomic: pieces go to ``.tmp-step_000100``, files and directory are fsynced, then one ``rename``
publishes the directory and ``latest`` is swapped with ``os.replace``. A crash before the rename leaves only
a ``.tmp-*`` directory that loading ignores, so the previous checkpoint stays the loadable one. Nothing
non-finite is published: the ranks agree first that every floating-point piece is finite.

Integrity (``integrity.py``): every piece's CRC-32 is in the index and checked on every read; piece file
names are confined to the checkpoint directory; damage is a one-line ``CheckpointError`` naming the file,
the tensor and the fix; ``latest_intact_checkpoint`` finds the newest checkpoint that verifies.

Resharding: a tensor is described by a ``Piece`` — the global shape of its *view* (head-split QKV weights are
stored as a (3, nh·hd, ...) view so whole heads are a plain split), one SBP per mesh axis and this rank's mesh
coords. Loading rebuilds a full tensor from the index and cuts the piece the *new* layout needs, whatever
layout saved it (dp=2 → tp=2, world size 2 → 1, ...).

Ranges: a piece entry may carry ``"range": [start, count]`` besides its ``extent`` — it then holds only the
elements ``[start, start + count)`` of the row-major flattening of the block the extent names (``BlockRangePiece``:
a ZeRO rank's part of its tp coordinate's block of a parameter, written without gathering the block). Entries
without ``range`` (every checkpoint written before ranges existed) hold their whole block.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors.torch import save_file

from ..comm.collectives import all_reduce, barrier
from ..mesh import Mesh
from ..sbp.placement import Replicate, Partial, Placement, format_sbp, parse_sbp
from ..sbp.spec import local_extent
from .integrity import (CHECKPOINTS, FORMAT, LATEST, CheckpointError, check_layout, fsync_path, latest_checkpoint,
                        latest_intact_checkpoint, load_index, read_piece, resolve_checkpoint, tensor_crc32,
                        verify_checkpoint)

__all__ = ["RangePiece", "BlockRangePiece", "Piece", "replicated_piece", "without_axis", "save_checkpoint", "Checkpoint",
           "latest_checkpoint", "resolve_checkpoint", "CHECKPOINTS", "CheckpointError", "verify_checkpoint",
           "latest_intact_checkpoint"]


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
        return all(c == 0 for p, c in zip(self.sbp, self.coords) if isinstance(p, Replicate))


@dataclass(frozen=True)
class RangePiece(Piece):
    """A piece that is one range ``[start, start + count)`` of a flattened tensor (``view_shape`` = (numel,)),
    written by its rank whatever the placement says: a ZeRO rank's part of a parameter, which need not be an
    even split of it. The index records the extent, so reading and verifying need nothing else."""

    rows: tuple[int, int] = (0, 0)

    def extent(self) -> list[tuple[int, int]]:
        return [self.rows]

    def owner(self) -> bool:
        return True


@dataclass(frozen=True)
class BlockRangePiece(Piece):
    """Elements ``[start, start + count)`` (``span``) of the row-major flattening of this rank's block (the
    ``extent`` its placement gives it in the view), held by one rank of the ``spread`` axis — a ZeRO rank's part of
    its tp coordinate's block of a parameter (a range of the tp-local tensor's flattening, which for a ``S(1)``
    block is no single range of the full tensor). Every rank along ``spread`` writes its own range; along the
    other replicated axes coordinate 0 writes (a tp-replicated parameter once). The index records the block's
    extent and the range (``"range"``)."""

    span: tuple[int, int] = (0, 0)
    spread: str = ""

    def owner(self) -> bool:
        return all(c == 0 for p, c, a in zip(self.sbp, self.coords, self.axes)
                   if isinstance(p, Replicate) and a != self.spread)


def replicated_piece(key: str, t: torch.Tensor, mesh: Mesh) -> Piece:
    """A tensor every rank holds whole (B on every axis)."""
    shape = tuple(t.shape)
    return Piece(key, t, shape, shape, tuple(Replicate() for _ in mesh.axes), tuple(mesh.axes), tuple(mesh.shape),
                 tuple(mesh.coord(a) for a in mesh.axes))


def without_axis(piece: Piece, axis: str) -> Piece:
    """``piece`` described on the mesh without ``axis``, which must be ``B`` for it: only one coordinate along
    ``axis`` holds the tensor at all (a pipeline stage's tensor on its pp coordinate; a ZeRO group of one tp
    coordinate, saved under a key of its own), or every coordinate would hold the same values."""
    keep = [i for i, a in enumerate(piece.axes) if a != axis]
    if any(not isinstance(piece.sbp[i], Replicate) for i, a in enumerate(piece.axes) if a == axis):
        raise ValueError(f"{piece.key}: split over the mesh axis {axis!r} ({piece.sbp}), which this tensor is saved "
                         f"without; a tensor held by one coordinate of {axis!r} must be whole there (B)")
    # replace() keeps the piece's kind (a range piece stays one)
    return replace(piece, sbp=tuple(piece.sbp[i] for i in keep), axes=tuple(piece.axes[i] for i in keep),
                   mesh_shape=tuple(piece.mesh_shape[i] for i in keep), coords=tuple(piece.coords[i] for i in keep))


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
    _refuse_nonfinite(step, pieces, mesh)
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
        fsync_path(root)
        pointer = root / f".{LATEST}.tmp"
        pointer.write_text(name + "\n")
        fsync_path(pointer)
        os.replace(pointer, root / LATEST)
        fsync_path(root)
        _prune(root, keep)
    _barrier_all(mesh)
    return final


_CHUNK = 1 << 20  # elements checked at once: the check's mask stays 1 MiB, not a quarter of the largest tensor


def _finite(t: torch.Tensor) -> bool:
    flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + _CHUNK]).all()) for i in range(0, flat.numel(), _CHUNK))


def _first_nonfinite(pieces: Sequence[Piece]) -> str | None:
    for p in pieces:
        if p.local.is_floating_point() and not _finite(p.local):
            return p.key
    return None


def _refuse_nonfinite(step: int, pieces: Sequence[Piece], mesh: Mesh) -> None:
    """Raise ``ValueError`` on every rank (before anything is written) if any rank holds a non-finite piece.
    Collective: a max over each mesh axis in turn, so every rank takes the same branch."""
    bad = _first_nonfinite(pieces)
    flag = torch.tensor([0.0 if bad is None else 1.0], device=mesh.device)
    for axis in mesh.axes:
        all_reduce(flag, mesh, axis, op="max")
    if flag.item() > 0:
        where = f"{bad!r} on rank {mesh.rank} holds" if bad is not None else "another rank holds a tensor with"
        raise ValueError(f"checkpoint of step {step} refused: {where} NaN/Inf values; nothing was written and "
                         f"'latest' is unchanged; the training diverged: resume from the previous checkpoint with a "
                         f"lower learning rate (or train.nonfinite = \"skip\")")


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
            entry["piece"] = {"file": f"rank{rank:05d}.safetensors", "extent": p.extent(),
                              "crc32": tensor_crc32(tensors[p.key])}
            if isinstance(p, BlockRangePiece):
                entry["piece"]["range"] = list(p.span)
        entries.append(entry)
    data = tmp / f"rank{rank:05d}.safetensors"
    save_file(tensors, str(data))
    meta = tmp / f"rank{rank:05d}.json"
    meta.write_text(json.dumps({"entries": entries, "state": rank_state}))
    for path in (data, meta):
        fsync_path(path)


def _write_index(tmp: Path, step: int, mesh: Mesh, state: dict[str, Any]) -> None:
    tensors: dict[str, dict[str, Any]] = {}
    for r in range(mesh.world_size):
        for e in json.loads((tmp / f"rank{r:05d}.json").read_text())["entries"]:
            info = tensors.setdefault(e["key"], {k: e[k] for k in ("view_shape", "full_shape", "dtype", "sbp", "axes")})
            if "piece" in e:
                info.setdefault("pieces", []).append(e["piece"])
    index = {"format": FORMAT, "step": step, "mesh": dict(zip(mesh.axes, mesh.shape)),
             "world_size": mesh.world_size, "state": state, "tensors": tensors}
    path = tmp / "index.json"
    path.write_text(json.dumps(index, indent=1))
    fsync_path(path)
    fsync_path(tmp)


def _prune(root: Path, keep: int) -> None:
    done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_"))
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _place(view: torch.Tensor, extent: tuple[tuple[int, int], ...], values: torch.Tensor) -> None:
    """Copy ``values`` (any shape, row-major) into the block ``extent`` of ``view``."""
    index = tuple(slice(s, s + n) for s, n in extent)
    view[index] = values.reshape(view[index].shape)


class Checkpoint:
    """A saved checkpoint opened for reading (any rank, any layout; reads files only, never communicates)."""

    def __init__(self, path: str | Path) -> None:
        self.path = resolve_checkpoint(path)
        self.index = load_index(self.path)  # CheckpointError: not JSON, unknown format, unconfined file names
        self.step: int = self.index["step"]
        self.state: dict[str, Any] = self.index["state"]
        self.omitted: set[str] = set(self.state.get("frozen_not_saved") or [])
        """Model names saved without their values (``train.save_frozen = false``, ``frozen.py``): loaders skip them."""

    def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.index["tensors"] if k.startswith(prefix)]

    def rank_state(self, rank: int) -> dict[str, Any] | None:
        path = self.path / f"rank{rank:05d}.json"
        return json.loads(path.read_text())["state"] if path.is_file() else None

    def full(self, key: str) -> torch.Tensor:
        """The whole tensor under its plain-model shape, assembled from every piece, each verified as it is
        read (file present and confined, shape, dtype, checksum; coverage): ``CheckpointError`` otherwise."""
        info = self._info(key)
        view = torch.empty(info["view_shape"], dtype=check_layout(self.path, key, info))
        blocks: dict[tuple[tuple[int, int], ...], list[Any]] = {}  # ranged blocks being filled: [flat, count]
        for piece in info.get("pieces", []):
            local = read_piece(self.path, key, info, piece)
            extent = tuple((s, n) for s, n in piece["extent"])
            if "range" not in piece:
                _place(view, extent, local)
                continue
            # a range of the block's flattening: filled into a flat copy of the block (a S(1) block is no
            # contiguous part of the view), placed once its ranges are all in
            block = blocks.setdefault(extent, [torch.empty(math.prod(n for _, n in extent), dtype=view.dtype), 0])
            start, count = piece["range"]
            block[0][start:start + count] = local.reshape(-1)
            block[1] += count
            if block[1] == block[0].numel():
                _place(view, extent, blocks.pop(extent)[0])
        for extent, (flat, _) in blocks.items():  # unreachable after check_layout's coverage check; kept total
            _place(view, extent, flat)
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
            if key.removeprefix("model/") in self.omitted:
                raise ValueError(f"checkpoint {self.path} left out the frozen parameter {key.removeprefix('model/')!r} "
                                 f"(saved with train.save_frozen = false); build the model from its pretrained base "
                                 f"first (model.pretrained) and load only what was saved") from None
            raise ValueError(f"checkpoint {self.path} has no tensor {key!r}; it holds "
                             f"{sorted(self.index['tensors'])[:8]}...") from None



