"""Sharded save/load for models wrapped by ``sw.zero``: optimizer state lives on flat shards.

A ZeRO flat group lays its parameters end to end in one buffer of ``L`` elements; each dp rank owns the slice
``shard_sizes(L, N)`` gives it, which is exactly ``S(0)`` of a length-``L`` tensor over the dp axis. So the
per-group optimizer state is saved as ``zero/<group>/<state>`` with SBP ``S(0)`` over dp, and the groups'
parameter names and sizes go into the index state (ZeRO-1 inside a pipeline: groups per pp coordinate, listed
in the rank files, ``pipeline_zero.py``).

Tensor parallelism inside (mesh ``(dp, tp)``): each tp coordinate's groups hold its *local* tp pieces, so a
group is a different tensor on every tp coordinate. It is saved under a key of its own, ``zero/<i>.tp<c>/…``,
described on the mesh without tp (``S(0)`` over dp, written by the dp ranks of that tp coordinate), and every
rank lists its groups — with each parameter's extent in the full tensor — in its rank file
(``flat_state.py`` reassembles full per-parameter tensors from them).

Parameters are written from each rank's own flat range, nothing gathered, in every stage: without tp as ranges of
the flattened parameters (``RangePiece``); with tp as ranges of the flattening of this tp coordinate's block of
each parameter (``BlockRangePiece``: the block is the extent ``layout.describe`` gives the tp piece — a ``S(1)``
block is no single range of the full tensor — and the range is the part of it this dp rank owns; a parameter
replicated over tp is written by tp coordinate 0's dp ranks). They load with the wrapper's ``load_state_dict``
(full tensors, any stage).

Loading converts in both directions through full per-parameter tensors (``param_state``): ZeRO ↔ plain
data/tensor parallelism, any stage, any dp and tp size.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..mesh import Mesh
from ..parallel.zero.wrap import ZeroModel
from ..parallel.zero.flat import FlatGroup
from ..parallel.zero.optim import ZeroOptimizer
from ..sbp.placement import Replicate, Split
from .flat_state import param_state, saved_groups
from .layout import describe, local_of
from .sharded import BlockRangePiece, Checkpoint, Piece, RangePiece, replicated_piece, without_axis

__all__ = ["zero_model_pieces", "zero_optimizer_pieces", "zero_groups_state", "zero_index_state", "param_state",
           "saved_groups", "fill_flat_state", "load_zero", "tag_axes", "group_tag", "flat_state_pieces",
           "group_entry"]


def tag_axes(mesh: Mesh, axis: str, skip: Sequence[str] = ()) -> list[str]:
    """The mesh axes besides the ZeRO ``axis`` (and ``skip``: a pipeline's pp, keyed separately) along which a
    flat group differs per coordinate: every other axis of size > 1 (tensor parallelism inside). Pure."""
    return [a for a in mesh.axes if a != axis and a not in skip and mesh.size(a) > 1]


def group_tag(mesh: Mesh, axes: Sequence[str]) -> str:
    """``".tp1"`` for this rank's coordinates along ``axes`` (empty without any): appended to group keys."""
    return "".join(f".{a}{mesh.coord(a)}" for a in axes)


def flat_state_pieces(key: str, g: FlatGroup, state: dict[str, Any], mesh: Mesh, axis: str,
                      drop: Sequence[str]) -> list[Piece]:
    """Pieces of one group's optimizer state (``zero/<key>/<state>``): a length-``L`` tensor ``S(0)`` over
    ``axis`` (this rank's ``[lo, hi)``), a scalar (Adam's step) ``B``; described without the ``drop`` axes,
    along which the key itself differs. Local."""
    coords = tuple(mesh.coord(a) for a in mesh.axes)
    sbp = tuple(Split(0) if a == axis else Replicate() for a in mesh.axes)
    out: list[Piece] = []
    for name, value in state.items():
        value = torch.as_tensor(value).detach()
        if value.dim() == 1 and value.numel() == g.hi - g.lo:
            total = (g.layout.total,)
            piece = Piece(f"zero/{key}/{name}", value, total, total, sbp, tuple(mesh.axes), tuple(mesh.shape), coords)
        else:
            piece = replicated_piece(f"zero/{key}/{name}", value, mesh)
        for a in drop:
            piece = without_axis(piece, a)
        out.append(piece)
    return out


def group_entry(key: str, g: FlatGroup, names: list[str], mesh: Mesh) -> dict[str, Any]:
    """JSON description of one flat group: key, plain parameter names, element counts, local shapes, and each
    parameter's global view shape, full shape and the extent of this rank's piece in the view. Pure."""
    pieces = [describe(n, p, mesh, torch.empty(s, device="meta")) for n, p, s in zip(names, g.params, g.shapes)]
    return {"key": key, "names": list(names), "numels": list(g.layout.numels), "shapes": [list(s) for s in g.shapes],
            "views": [list(p.view_shape) for p in pieces], "full_shapes": [list(p.full_shape) for p in pieces],
            "extents": [[list(e) for e in p.extent()] for p in pieces]}


def zero_model_pieces(model: ZeroModel, mesh: Mesh) -> list[Piece]:
    """This rank's pieces of the parameters, written from the flat-group elements it owns (``g.master``, master
    precision): nothing is gathered and no rank holds more than its shard — the model may not fit one device.
    Without tp: ranges of the flattened parameters (``RangePiece``); with tp inside: ranges of this tp
    coordinate's block of each parameter (``BlockRangePiece``). Frozen parameters and buffers: as the module
    holds them. Each storage once. Local."""
    ranges = _block_ranges if tag_axes(mesh, model.axis) else _flat_ranges
    out: list[Piece] = []
    managed: set[int] = set()
    for g in model.flat_groups:  # stage 3: the frozen parameters' groups too
        out += ranges(g, mesh, model.axis)
        managed |= {id(p) for p in g.params}
    seen = set(managed)
    for key, value in model.module.state_dict(keep_vars=True).items():  # frozen parameters, buffers
        if id(value) not in seen:
            seen.add(id(value))
            out.append(describe(f"model/{key}", value, mesh, value.detach()))
    return out


def _owned(g: FlatGroup, axis: str) -> Iterator[tuple[int, int, int, torch.Tensor]]:
    """``(k, a, b, values)``: elements ``[a, b)`` of parameter ``k``'s (tp-local) flattening that this rank owns,
    and a view of them in its master shard."""
    master = g.master.detach()
    for k, a, b in g.layout.pieces(g.mesh.coord(axis)):
        start = g.layout.offsets[k] + a - g.lo  # in this rank's shard
        yield k, a, b, master[start:start + b - a]


def _flat_ranges(g: FlatGroup, mesh: Mesh, axis: str) -> list[Piece]:
    coords = tuple(mesh.coord(a) for a in mesh.axes)
    sbp = tuple(Split(0) if a == axis else Replicate() for a in mesh.axes)
    return [RangePiece(f"model/{g.names[k]}", values, (g.layout.numels[k],), tuple(g.shapes[k]), sbp,
                       tuple(mesh.axes), tuple(mesh.shape), coords, rows=(a, b - a))
            for k, a, b, values in _owned(g, axis)]


def _block_ranges(g: FlatGroup, mesh: Mesh, axis: str) -> list[Piece]:
    # describe() gives the tp block (view shape, placement, extent) from the parameter's own annotations, which
    # a freed stage-3 parameter keeps; the range is of the block's row-major flattening, which is the tp-local
    # tensor's flattening (a head-split QKV block reshaped to its (3, nh/tp·hd, ...) view keeps its order)
    out: list[Piece] = []
    for k, a, b, values in _owned(g, axis):
        piece = describe(f"model/{g.names[k]}", g.params[k], mesh, torch.empty(g.shapes[k], device="meta"))
        out.append(BlockRangePiece(piece.key, values, piece.view_shape, piece.full_shape, piece.sbp, piece.axes,
                                   piece.mesh_shape, piece.coords, span=(a, b - a), spread=axis))
    return out


def _keys(model: ZeroModel) -> list[str]:
    tag = group_tag(model.mesh, tag_axes(model.mesh, model.axis))
    return [f"{i}{tag}" for i in range(len(model.groups))]


def zero_optimizer_pieces(model: ZeroModel, optimizer: ZeroOptimizer, mesh: Mesh, axis: str = "dp") -> list[Piece]:
    """This rank's flat optimizer-state shards as ``S(0)`` pieces of each group's length-L state. Local."""
    drop = tag_axes(mesh, axis)
    return [piece for key, g in zip(_keys(model), model.groups)
            for piece in flat_state_pieces(key, g, optimizer.optimizer.state.get(g.master, {}), mesh, axis, drop)]


def zero_groups_state(model: ZeroModel) -> list[dict[str, Any]]:
    """JSON-able description of this rank's flat groups (``group_entry``), for the index or the rank file."""
    return [group_entry(key, g, list(g.names), model.mesh) for key, g in zip(_keys(model), model.groups)]


def zero_index_state(model: ZeroModel) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(index state, rank state)`` entries describing the groups: in the index when every rank's groups
    are the same (no tp), else each rank lists its own in its rank file."""
    if not tag_axes(model.mesh, model.axis):
        return {"zero_groups": zero_groups_state(model)}, {}
    return {"zero_groups_per_rank": True}, {"zero_groups": zero_groups_state(model)}


@torch.no_grad()
def fill_flat_state(inner: torch.optim.Optimizer, groups: Sequence[FlatGroup], group_names: list[list[str]],
                    saved: dict[str, list[str]], fetch: Callable[[str, str], torch.Tensor]) -> None:
    """Set ``inner``'s state of each flat group's ``master`` (this rank's ``[lo, hi)`` shard) from full
    per-parameter state (``param_state``), cutting this rank's tp piece of each; ``group_names``: the plain
    parameter names of each group. Local."""
    for g, names in zip(groups, group_names):
        new: dict[str, torch.Tensor] = {}
        for state in saved.get(names[0], []):
            values = [fetch(n, state) for n in names]
            if values[0].dim() == 0:  # e.g. Adam's step: one scalar per group
                new[state] = values[0].clone()
            else:
                flat = torch.cat([local_of(v, p, g.mesh, s).reshape(-1) for v, p, s in zip(values, g.params, g.shapes)])
                new[state] = flat[g.lo:g.hi].to(g.master.device, g.master.dtype).clone()
        if new:
            inner.state[g.master] = new


class _Lazy(Mapping[str, torch.Tensor]):
    """The checkpoint's full tensors under the plain model's keys, each read when asked for: loading holds one
    flat group's full values at a time, never the whole model."""

    def __init__(self, ckpt: Checkpoint, keys: list[str], aliases: dict[str, str]) -> None:
        self.ckpt, self.keys_, self.aliases = ckpt, keys, aliases

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.ckpt.full(f"model/{self.aliases.get(key, key)}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __contains__(self, key: object) -> bool:  # without reading the tensor (Mapping's default would)
        return key in self.keys_

    def __len__(self) -> int:
        return len(self.keys_)


@torch.no_grad()
def load_zero(ckpt: Checkpoint, model: ZeroModel, optimizer: ZeroOptimizer) -> None:
    """Load parameters (full, any stage; each rank keeps its tp piece) and rebuild this rank's flat
    optimizer-state shards. Local."""
    plain: nn.Module = model.module
    # frozen parameters a checkpoint left out (frozen.py) keep the values the model was built with
    keys = [k for k in plain.state_dict(keep_vars=True) if k not in ckpt.omitted]
    model.load_state_dict(_Lazy(ckpt, keys, ckpt.state.get("aliases", {})), strict=not ckpt.omitted)
    names, fetch = param_state(ckpt)
    fill_flat_state(optimizer.optimizer, model.groups, [list(g.names) for g in model.groups], names, fetch)
