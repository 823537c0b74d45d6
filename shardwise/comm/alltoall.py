"""All-to-all with uneven splits over one mesh axis: native or ours (pairwise), the counts exchange, autograd.

``all_to_all_single(out, inp, mesh, axis, out_splits=, in_splits=)``: rank ``i`` cuts ``inp`` (rows along dim
0) into ``p`` consecutive pieces of ``in_splits[j]`` rows and sends piece ``j`` to coordinate ``j``; it
receives ``out_splits[j]`` rows from coordinate ``j`` into ``out``, pieces in coordinate order. The splits
are per rank and may be uneven or zero; they must be consistent across the group (``in_splits[j]`` of rank
``i`` equals ``out_splits[i]`` of rank ``j``), which ``Mesh(debug=True)`` checks before every call.

``algorithm``:

* ``"native"``: the backend's ``all_to_all_single`` on the axis' group (gloo and NCCL both take uneven
  splits along dim 0; tensors travel as bytes, so every dtype crosses gloo).
* ``"pairwise"``: ours, ``p - 1`` rounds on the axis' point-to-point group: in round ``r`` rank ``i`` sends
  to ``(i + r) % p`` and receives from ``(i - r) % p`` (one ``batch_isend_irecv`` per round, so the send and
  the receive of a round proceed together and every pair of ranks talks exactly once per direction);
  zero-row pieces send nothing and the rank's own piece is a local copy. Pieces go straight from ``inp``'s
  rows into ``out``'s rows: no packing copies.
* ``"auto"``: ``native`` unless the mesh's calibration for groups of ``p`` has both ``all_to_all`` models and
  ``pairwise``'s is no worse at every size (``alpha`` and ``beta`` both lower or equal, one strictly). The
  choice cannot depend on the message size: with uneven splits every rank moves a different number of
  bytes, and ranks that chose differently would hang.

Every call is recorded by ``CommCounter`` as one ``all_to_all`` of the bytes of this rank's ``inp``; the
pairwise algorithm also counts its messages.
"""

from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ..mesh import Mesh
from .collectives import _run, link_for
from .counter import record_collective, record_message
from .handles import Handle
from .ops import gather_into_tensor

__all__ = ["all_to_all_single", "exchange_counts", "all_to_all_autograd", "AllToAll", "A2A_ALGORITHMS",
           "choose_all_to_all"]

A2A_ALGORITHMS: tuple[str, ...] = ("native", "pairwise")
"""The implementations of the uneven all-to-all (what ``shardwise bench comm --ops all_to_all`` measures)."""
_CHOICES = (*A2A_ALGORITHMS, "auto")


def choose_all_to_all(calibration: Any | None) -> str:
    """The implementation ``"auto"`` runs given the calibration of the group's size (or ``None``). Pure, and
    independent of the message size so that every rank of a group picks the same one."""
    models = getattr(calibration, "models", {}).get("all_to_all", {}) if calibration is not None else {}
    native, pairwise = models.get("native"), models.get("pairwise")
    if native is None or pairwise is None:
        return "native"
    no_worse = (pairwise.alpha_us <= native.alpha_us and pairwise.beta_us_per_byte <= native.beta_us_per_byte)
    better = (pairwise.alpha_us < native.alpha_us or pairwise.beta_us_per_byte < native.beta_us_per_byte)
    return "pairwise" if no_worse and better else "native"


def _row_counts(splits: Sequence[Any], name: str) -> list[int]:
    """``splits`` as python ints (numpy or 0-d torch integers are fine: ``counts.tolist()`` is not required)."""
    try:
        return [operator.index(s) for s in splits]
    except TypeError:
        raise ValueError(f"all_to_all_single {name} {list(splits)} must be integer row counts; convert with "
                         f"[int(s) for s in {name}]") from None


def _check_splits(n: int, axis: str, out_splits: Sequence[int], in_splits: Sequence[int], algorithm: str) -> None:
    """The algorithm and the splits' lengths and values; ``ValueError`` naming the values and the fix."""
    if algorithm not in _CHOICES:
        raise ValueError(f"all_to_all_single algorithm {algorithm!r} is unknown; choose one of {list(_CHOICES)}")
    for name, splits in (("in_splits", in_splits), ("out_splits", out_splits)):
        if len(splits) != n:
            raise ValueError(f"all_to_all_single {name} has {len(splits)} entries but axis {axis!r} has {n} "
                             f"ranks; give one row count per rank of the axis")
        if any(s < 0 for s in splits):
            raise ValueError(f"all_to_all_single {name} {list(splits)} must be non-negative row counts; a "
                             f"rank that sends or receives nothing from a peer gives 0")


def _check(out: torch.Tensor, inp: torch.Tensor, n: int, axis: str, out_splits: Sequence[int],
           in_splits: Sequence[int], algorithm: str, me: int) -> None:
    """Every local constraint, before any communication; ``ValueError`` naming the values and the fix."""
    _check_splits(n, axis, out_splits, in_splits, algorithm)
    if inp.dim() < 1 or sum(in_splits) != inp.shape[0]:
        raise ValueError(f"all_to_all_single in_splits {list(in_splits)} sum to {sum(in_splits)} but the input "
                         f"has {inp.shape[0] if inp.dim() else 'no'} rows (shape {list(inp.shape)}); the splits "
                         f"must add up to the rows of dim 0")
    if out.dim() < 1 or sum(out_splits) != out.shape[0]:
        raise ValueError(f"all_to_all_single out_splits {list(out_splits)} sum to {sum(out_splits)} but out has "
                         f"{out.shape[0] if out.dim() else 'no'} rows (shape {list(out.shape)}); allocate out "
                         f"as torch.empty(sum(out_splits), *inp.shape[1:])")
    if (out.shape[1:] != inp.shape[1:] or out.dtype != inp.dtype or out.device != inp.device
            or not out.is_contiguous()):
        raise ValueError(f"all_to_all_single out must be a contiguous {inp.dtype} tensor of rows "
                         f"{list(inp.shape[1:])} on {inp.device} like the input, got "
                         f"{'a non-contiguous ' if not out.is_contiguous() else ''}{out.dtype} "
                         f"{list(out.shape)} on {out.device}; allocate it with torch.empty")
    if out_splits[me] != in_splits[me]:
        raise ValueError(f"all_to_all_single: this rank (coordinate {me}) sends itself in_splits[{me}]="
                         f"{in_splits[me]} rows but expects out_splits[{me}]={out_splits[me]}; they must match")


def _check_consistent(mesh: Mesh, axis: str, out_splits: Sequence[int], in_splits: Sequence[int],
                      row_bytes: int, algorithm: str) -> None:
    """Debug mode, collective: every rank's sends must be what their receivers expect (else a hang)."""
    n = mesh.size(axis)
    mine = torch.tensor([*in_splits, *out_splits, row_bytes, A2A_ALGORITHMS.index(algorithm)], dtype=torch.int64)
    table = torch.empty(n * len(mine), dtype=torch.int64)
    if mesh.device.type != "cpu":
        mine, table = mine.to(mesh.device), table.to(mesh.device)
    gather_into_tensor(table, mine, group=mesh.group(axis))
    rows = table.view(n, len(mine)).cpu().tolist()
    bad = [f"rank {i} sends {rows[i][j]} rows to {j}, which expects {rows[j][n + i]}"
           for i in range(n) for j in range(n) if rows[i][j] != rows[j][n + i]]
    if len({r[2 * n] for r in rows}) > 1 or len({r[2 * n + 1] for r in rows}) > 1:
        bad.append(f"row bytes {[r[2 * n] for r in rows]} / algorithms "
                   f"{[A2A_ALGORITHMS[r[2 * n + 1]] for r in rows]} differ")
    if bad:
        raise ValueError(f"ranks of axis {axis!r} disagree on all_to_all_single: {'; '.join(bad[:4])}; "
                         f"in_splits[j] of rank i must equal out_splits[i] of rank j")


def _as_rows_of_bytes(t: torch.Tensor, inner: int) -> torch.Tensor:
    # (rows, *rest) dtype -> (rows, inner * itemsize) uint8 sharing storage: any dtype crosses any backend
    return t.reshape(t.shape[0], inner).view(torch.uint8)


def all_to_all_single(out: torch.Tensor, inp: torch.Tensor, mesh: Mesh, axis: str, *, out_splits: Sequence[int],
                      in_splits: Sequence[int], algorithm: str = "native",
                      async_op: bool = False) -> torch.Tensor | Handle:
    """Send ``inp[(rows of piece j)]`` to coordinate ``j`` and receive coordinate ``j``'s piece into ``out``.

    ``inp``: ``(sum(in_splits), *rest)``; ``out``: ``(sum(out_splits), *rest)``, contiguous, same dtype and
    device; ``in_splits`` / ``out_splits``: one row count per rank of ``axis`` (uneven, zeros allowed).
    Returns ``out`` (or a ``Handle`` whose ``wait()`` returns it). Collective over ``axis``."""
    n, me = mesh.size(axis), mesh.coord(axis)
    in_splits, out_splits = _row_counts(in_splits, "in_splits"), _row_counts(out_splits, "out_splits")
    _check(out, inp, n, axis, out_splits, in_splits, algorithm, me)
    if algorithm == "auto":
        algorithm = "native" if n < 2 else choose_all_to_all(mesh.calibration_for(n))
    inner = math.prod(inp.shape[1:])
    record_collective("all_to_all", algorithm, axis, inp.numel() * inp.element_size(), n)
    if mesh.debug:
        _check_consistent(mesh, axis, out_splits, in_splits, inner * inp.element_size(), algorithm)
    x = inp.contiguous()
    if inner == 0:  # rows of nothing (the same on every rank: the row shape is shared): no bytes to move
        return Handle(finish=lambda: out) if async_op else out
    src, dst = _as_rows_of_bytes(x, inner), _as_rows_of_bytes(out, inner)
    if algorithm == "native":
        work = dist.all_to_all_single(dst, src, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                      group=mesh.group(axis), async_op=async_op)
        # the handle keeps the (possibly temporary, made contiguous) input alive until the exchange is done
        return Handle(work=work, finish=lambda keep=src: out) if async_op else out

    def job() -> torch.Tensor:
        _pairwise(dst, src, mesh, axis, out_splits, in_splits)
        return out
    return _run(mesh, axis, job, async_op)


def _offsets(splits: Sequence[int]) -> list[int]:
    offsets = [0]
    for s in splits:
        offsets.append(offsets[-1] + s)
    return offsets


def _pairwise(dst: torch.Tensor, src: torch.Tensor, mesh: Mesh, axis: str, out_splits: list[int],
              in_splits: list[int]) -> None:
    """``p - 1`` rounds of one send and one receive (rows of bytes, straight between the tensors' rows)."""
    link = link_for(mesh, axis)
    n, me = link.size, link.index
    so, ro = _offsets(in_splits), _offsets(out_splits)
    dst[ro[me]:ro[me + 1]].copy_(src[so[me]:so[me + 1]])
    for r in range(1, n):
        to, frm = (me + r) % n, (me - r) % n
        ops = []
        if in_splits[to]:
            piece = src[so[to]:so[to + 1]]
            record_message(piece.numel(), sent=True)
            ops.append(dist.P2POp(dist.isend, piece, peer=link.ranks[to], group=link.group))
        if out_splits[frm]:
            piece = dst[ro[frm]:ro[frm + 1]]
            record_message(piece.numel(), sent=False)
            ops.append(dist.P2POp(dist.irecv, piece, peer=link.ranks[frm], group=link.group))
        if ops:  # both sides of a zero-row piece skip it: the sender's in_splits is the receiver's out_splits
            for work in dist.batch_isend_irecv(ops):
                work.wait()


def exchange_counts(counts: torch.Tensor, mesh: Mesh, axis: str, *, algorithm: str = "native") -> torch.Tensor:
    """The counts-first exchange that sizes an uneven all-to-all: ``counts`` ``(p*k,)`` int64, entries
    ``[j*k:(j+1)*k]`` meant for coordinate ``j`` (e.g. tokens per local expert of rank ``j``); returns the
    ``(p*k,)`` counts received, entries ``[j*k:(j+1)*k]`` from coordinate ``j``. One all-to-all of equal
    splits. Collective over ``axis``."""
    n = mesh.size(axis)
    if counts.dim() != 1 or counts.dtype != torch.int64 or counts.numel() % n:
        raise ValueError(f"exchange_counts needs a 1-D int64 tensor of p*k counts (p={n} ranks of axis "
                         f"{axis!r}), got {counts.dtype} of shape {list(counts.shape)}; pass "
                         f"counts.reshape(-1).long() with k entries per rank")
    k = counts.numel() // n
    out = torch.empty_like(counts, memory_format=torch.contiguous_format)
    result = all_to_all_single(out, counts, mesh, axis, out_splits=[k] * n, in_splits=[k] * n,
                               algorithm=algorithm)
    assert isinstance(result, torch.Tensor)
    return result


class AllToAll(torch.autograd.Function):
    """Forward: ``all_to_all_single`` with ``in_splits -> out_splits``; backward: the reverse all-to-all of
    the gradient (``out_splits -> in_splits``), which is the exact adjoint of a permutation of rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: Mesh, axis: str, out_splits: list[int], in_splits: list[int],
                algorithm: str) -> torch.Tensor:  # type: ignore[override]
        ctx.mesh, ctx.axis, ctx.splits, ctx.algorithm = mesh, axis, (out_splits, in_splits), algorithm
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        all_to_all_single(out, x, mesh, axis, out_splits=out_splits, in_splits=in_splits, algorithm=algorithm)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        g_in = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        all_to_all_single(g_in, grad.contiguous(), ctx.mesh, ctx.axis, out_splits=in_splits,
                          in_splits=out_splits, algorithm=ctx.algorithm)
        return g_in, None, None, None, None, None


def all_to_all_autograd(x: torch.Tensor, mesh: Mesh, axis: str, out_splits: Sequence[int],
                        in_splits: Sequence[int], *, algorithm: str = "native") -> torch.Tensor:
    """Differentiable ``all_to_all_single``: ``x`` ``(sum(in_splits), *rest)`` -> a new
    ``(sum(out_splits), *rest)``; its gradient flows back through the reverse all-to-all. Collective over
    ``axis`` in forward and in backward (every rank of the axis must run backward through it)."""
    in_splits, out_splits = _row_counts(in_splits, "in_splits"), _row_counts(out_splits, "out_splits")
    n = mesh.size(axis)
    _check_splits(n, axis, out_splits, in_splits, algorithm)  # before forward allocates sum(out_splits) rows
    if algorithm == "auto":  # resolved once, so that backward runs what forward ran
        algorithm = "native" if n < 2 else choose_all_to_all(mesh.calibration_for(n))
    return AllToAll.apply(x, mesh, axis, out_splits, in_splits, algorithm)
