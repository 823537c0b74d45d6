"""Reading ZeRO's flat optimizer state back as full per-parameter tensors, whatever layout saved it.

A flat group lays its parameters end to end in one buffer of ``L`` elements; its state (AdamW's m and v) is
saved as ``zero/<key>/<state>``, a length-``L`` tensor, and the group is described by a JSON entry: ``key``,
the plain parameter ``names``, their ``numels`` and local ``shapes``. With tensor parallelism inside, each tp
coordinate has its own groups (keys ``<i>.tp<c>``: ``zero_layout.py``, ``pipeline_zero.py``) holding that
coordinate's *pieces* of the parameters, so an entry also gives, per parameter, the global ``views`` shape
(a head-split QKV weight: its (3, nh·hd, ...) view), its ``full_shapes`` and the ``extents`` — ``(start,
length)`` per dim of the view — that the piece fills. ``fetch`` assembles the full tensor from every group
holding a piece of it; a replicated parameter (a layer norm) sits whole in the group of every tp coordinate,
and any copy serves. Entries without ``extents`` (older checkpoints, and every one without tp) hold whole
parameters.

Where the entries are: ``sw.zero`` without tp, the index state's ``zero_groups`` (key = position); with tp,
and for ZeRO-1 inside a pipeline, every rank lists its own groups in its rank file (``"zero_groups_per_rank"``
or ``"pipeline_zero_groups"`` in the index state). Reads files only.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .integrity import CheckpointError
from .sharded import Checkpoint

__all__ = ["saved_groups", "param_state"]


class _Entry(NamedTuple):
    """One parameter's piece inside one saved flat group."""

    key: str
    offset: int
    numel: int
    shape: list[int]
    view: list[int] | None
    full_shape: list[int] | None
    extent: list[list[int]] | None


def saved_groups(ckpt: Checkpoint) -> list[dict[str, Any]]:
    """The checkpoint's flat groups, each with its ``key`` (``zero/<key>/<state>``): from the index state
    (key = position) and, where the groups are per rank, from every rank file (each key once)."""
    groups = [dict(g, key=g.get("key", str(i))) for i, g in enumerate(ckpt.state.get("zero_groups") or [])]
    if ckpt.state.get("pipeline_zero_groups") or ckpt.state.get("zero_groups_per_rank"):
        seen: dict[str, dict[str, Any]] = {}
        for rank in range(int(ckpt.index["world_size"])):
            for g in (ckpt.rank_state(rank) or {}).get("zero_groups", []):
                seen.setdefault(g["key"], g)
        groups += list(seen.values())
    return groups


def _entries(ckpt: Checkpoint) -> tuple[dict[str, list[str]], dict[str, list[_Entry]]]:
    names: dict[str, list[str]] = {}
    where: dict[str, list[_Entry]] = {}
    for g in saved_groups(ckpt):
        states = sorted({k.rpartition("/")[2] for k in ckpt.keys(f"zero/{g['key']}/")})
        offset = 0
        n = len(g["names"])
        views, fulls, extents = (g.get(f, [None] * n) for f in ("views", "full_shapes", "extents"))
        for name, numel, shape, view, full, extent in zip(g["names"], g["numels"], g["shapes"], views, fulls, extents):
            names[name] = states
            where.setdefault(name, []).append(_Entry(g["key"], offset, numel, shape, view, full, extent))
            offset += numel
    return names, where


def param_state(ckpt: Checkpoint) -> tuple[dict[str, list[str]], Callable[[str, str], torch.Tensor]]:
    """``(state names per parameter, fetch(param, state) -> full tensor)`` from either checkpoint format:
    per-parameter ``optim/<param>/<state>`` or ZeRO ``zero/<group>/<state>`` flat groups (any tp layout)."""
    names: dict[str, list[str]] = {}
    for key in ckpt.keys("optim/"):
        param, _, state = key[len("optim/"):].rpartition("/")
        names.setdefault(param, []).append(state)
    flat_names, where = _entries(ckpt)
    names.update(flat_names)
    cache: dict[str, torch.Tensor] = {}

    def flat(entry: _Entry, state: str) -> torch.Tensor:
        key = f"zero/{entry.key}/{state}"
        if key not in cache:
            cache[key] = ckpt.full(key)
        return cache[key]

    def fetch(param: str, state: str) -> torch.Tensor:
        if param not in where:
            return ckpt.full(f"optim/{param}/{state}")
        entries = where[param]
        first = flat(entries[0], state)
        if first.dim() != 1:  # a scalar such as Adam's step: one per group
            return first
        if entries[0].extent is None:  # a whole parameter in one group
            e = entries[0]
            return first[e.offset:e.offset + e.numel].reshape(e.shape)
        return _assemble(ckpt, param, state, entries, [flat(e, state) for e in entries])
    return names, fetch


def _assemble(ckpt: Checkpoint, param: str, state: str, entries: list[_Entry],
              flats: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of ``param``'s ``state`` from its pieces in several groups (one per tp coordinate)."""
    view_shape = entries[0].view
    view = torch.empty(view_shape, dtype=flats[0].dtype)  # type: ignore[arg-type]
    covered = torch.zeros(view_shape, dtype=torch.bool)  # type: ignore[arg-type]
    for e, values in zip(entries, flats):
        index = tuple(slice(s, s + n) for s, n in e.extent)  # type: ignore[union-attr]
        view[index] = values[e.offset:e.offset + e.numel].reshape(view[index].shape)
        covered[index] = True
    if not bool(covered.all()):
        raise CheckpointError(f"checkpoint {ckpt.path}: the flat optimizer state {state!r} of {param!r} lacks pieces "
                              f"(groups {[e.key for e in entries]}); a rank file is missing, use an intact checkpoint")
    return view.reshape(entries[0].full_shape)  # type: ignore[arg-type]
