"""Typed collectives over one axis of a ``Mesh``.

Every function here is **collective over the axis group**: every rank of ``mesh.ranks(axis)`` must call it
with matching arguments (same length, dtype, op, algorithm), in the same order. With ``mesh.debug`` set, a
small native all-gather of each call's signature runs first and a mismatch raises ``ValueError`` on every
rank instead of hanging or returning garbage.

``algorithm`` picks the implementation: ``"native"`` (the backend's own: gloo or NCCL), ``"ring"``
(bandwidth-optimal, ``ring.py``), ``"tree"`` (latency-optimal, ``tree.py``), ``"shm"`` (through a
shared-memory segment, for groups whose ranks share one host and tensors in host memory: ``shm.py``;
``ValueError`` otherwise) or ``"auto"`` (per call, the one with the lowest fitted cost in the mesh's
calibration for the group's size; ``native`` without one: ``auto.py``). Ring, tree and shm run on the
axis' comm worker thread when ``async_op=True``. Counters and the debug check see the implementation
that ran. Uneven sizes follow ``shard_sizes``: the first ``L % n`` ranks hold one extra row.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..mesh import Mesh
from .auto import resolve_algorithm
from .counter import record_collective
from .handles import Handle, worker_for
from .ops import (ALGORITHM_CHOICES, check_algorithm, check_dtype, check_op, gather_into_tensor,
                  reduce_scatter_into_tensor, shard_sizes)
from .p2p import AxisLink
from .ring import DEFAULT_PIECE_BYTES, ring_all_gather, ring_all_reduce, ring_broadcast, ring_reduce_scatter
from .shm import ShmGroup, check_shm_tensor
from .shm_rendezvous import shm_group_for
from .signature import check_agreement
from .tree import tree_all_gather, tree_all_reduce, tree_broadcast, tree_reduce_scatter

__all__ = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv",
           "isend", "irecv", "barrier", "link_for"]

_NATIVE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def link_for(mesh: Mesh, axis: str) -> AxisLink:
    """This rank's point-to-point view of ``axis``."""
    return AxisLink(mesh.p2p_group(axis), tuple(mesh.ranks(axis)), mesh.coord(axis))


def _run(mesh: Mesh, axis: str, job: Callable[[], torch.Tensor], async_op: bool) -> torch.Tensor | Handle:
    """Run a point-to-point algorithm: on the axis' worker thread when asynchronous or when earlier
    asynchronous calls are still queued there (to keep one order on every rank), else inline."""
    last = mesh.__dict__.get("_comm_last", {}).get(axis)
    if not async_op and (last is None or last.done()):
        return job()
    future = worker_for(mesh, axis).submit(job)
    mesh.__dict__.setdefault("_comm_last", {})[axis] = future
    return Handle(future=future) if async_op else future.result()


def _native_op(op: str) -> dist.ReduceOp:
    return _NATIVE_OPS["sum" if op == "avg" else op]


def all_reduce(t: torch.Tensor, mesh: Mesh, axis: str, *, op: str = "sum", algorithm: str = "native",
               async_op: bool = False, piece_bytes: int = DEFAULT_PIECE_BYTES) -> torch.Tensor | Handle:
    """Reduce ``t`` across ``axis`` **in place** and return it (or a ``Handle`` whose ``wait()`` returns it).
    ``op``: ``sum | avg | max | min`` (``avg`` needs a floating dtype). Collective."""
    check_algorithm(algorithm, ALGORITHM_CHOICES, "all_reduce")
    check_op(op, t.dtype)
    algorithm = resolve_algorithm(algorithm, mesh, axis, "all_reduce", t.numel() * t.element_size(), t.dtype)
    check_dtype(t.dtype, algorithm)
    n = mesh.size(axis)
    record_collective("all_reduce", algorithm, axis, t.numel() * t.element_size(), n)
    if mesh.debug:
        check_agreement(mesh, axis, "all_reduce", t, op=op, algorithm=algorithm)
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)

    def finish() -> torch.Tensor:
        if op == "avg" and algorithm == "native":
            flat.div_(n)
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(flat.view(t.shape))
        return t

    if algorithm == "native":
        work = dist.all_reduce(flat, op=_native_op(op), group=mesh.group(axis), async_op=async_op)
        if async_op:
            return Handle(work=work, finish=finish)
        return finish()
    if algorithm == "shm":
        return _shm_run(mesh, axis, t, lambda g: g.all_reduce(flat, op, piece_bytes), finish, async_op)
    link = link_for(mesh, axis)
    algo = ring_all_reduce if algorithm == "ring" else tree_all_reduce

    def job() -> torch.Tensor:
        algo(flat, link, op, piece_bytes)
        return finish()
    return _run(mesh, axis, job, async_op)


def _shm_group(mesh: Mesh, axis: str, t: torch.Tensor) -> ShmGroup | None:
    """The axis' shared-memory group (``None`` for a group of one), set up on first use (collective, on the
    calling thread: never on the worker, so the rendezvous keeps its place among the group's backend
    collectives)."""
    check_shm_tensor(t)
    return shm_group_for(mesh, axis)


def _shm_run(mesh: Mesh, axis: str, t: torch.Tensor, move: Callable[[ShmGroup], object],
             finish: Callable[[], torch.Tensor], async_op: bool) -> torch.Tensor | Handle:
    """An in-place shm collective: ``move(group)`` (skipped for a group of one), then ``finish``; on the axis'
    worker when asynchronous, like ring and tree."""
    group = _shm_group(mesh, axis, t)

    def job() -> torch.Tensor:
        if group is not None:
            move(group)
        return finish()
    return _run(mesh, axis, job, async_op)


def _rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with ``dim`` moved to the front, contiguous: rows are then contiguous runs of elements."""
    if not -t.dim() <= dim < max(t.dim(), 1):
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(t.shape)}")
    if t.dim() == 0:
        return t.reshape(1)
    if dim in (0, -t.dim()) and t.is_contiguous():
        return t  # already rows first (the common case: skip two tensor ops on a latency-bound call)
    return t.movedim(dim, 0).contiguous()


def all_gather(t: torch.Tensor, mesh: Mesh, axis: str, *, dim: int = 0, sizes: Sequence[int] | None = None,
               algorithm: str = "native", async_op: bool = False,
               piece_bytes: int = DEFAULT_PIECE_BYTES, out: torch.Tensor | None = None) -> torch.Tensor | Handle:
    """Concatenate every rank's ``t`` along ``dim`` (a new tensor). ``sizes[j]`` is rank ``j``'s size along
    ``dim`` when they differ (default: all equal to this rank's). Conjugate of ``reduce_scatter``. Collective.

    ``out``: a contiguous tensor of the result's shape, dtype and device to gather into instead of a new one
    (``dim`` 0 only); ``t`` may be this rank's own slice of it (ZeRO's shard of its flat buffer), which is then
    not copied at all. Saves an allocation and, for the caller who wanted the result in place, a copy."""
    check_algorithm(algorithm, ALGORITHM_CHOICES, "all_gather")
    n, i = mesh.size(axis), mesh.coord(axis)
    x = _rows_first(t, dim)
    rows = list(sizes) if sizes is not None else [x.shape[0]] * n
    if len(rows) != n or rows[i] != x.shape[0]:
        raise ValueError(f"all_gather sizes {rows} must have one entry per rank of axis {axis!r} ({n}) and "
                         f"entry {i} must equal this rank's size {x.shape[0]} along dim {dim}")
    algorithm = resolve_algorithm(algorithm, mesh, axis, "all_gather",
                                  sum(rows) * math.prod(x.shape[1:]) * x.element_size(), t.dtype)
    check_dtype(t.dtype, algorithm)
    record_collective("all_gather", algorithm, axis, x.numel() * x.element_size(), n)
    if mesh.debug:
        check_agreement(mesh, axis, "all_gather", x, algorithm=algorithm, sizes=rows)
    inner = math.prod(x.shape[1:])
    shape = (sum(rows), *x.shape[1:])
    if out is None:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        _check_gather_out(out, shape, x, dim, t.dim())
    flat = out.reshape(-1)
    offsets = [r * inner for r in _cumsum(rows)]
    own = flat[offsets[i]:offsets[i + 1]]
    if not _same_memory(own, x):
        own.copy_(x.reshape(-1))

    def finish() -> torch.Tensor:
        return out.movedim(0, dim) if t.dim() > 0 and dim not in (0, -t.dim()) else out

    if algorithm == "native":
        return _native_all_gather(flat, x, rows, inner, mesh.group(axis), async_op, finish)
    if algorithm == "shm":
        return _shm_run(mesh, axis, t, lambda g: g.all_gather(flat, offsets, piece_bytes), finish, async_op)
    link = link_for(mesh, axis)

    def job() -> torch.Tensor:
        if algorithm == "ring":
            ring_all_gather(flat, link, offsets, piece_bytes)
        else:
            tree_all_gather(flat, link, offsets)
        return finish()
    return _run(mesh, axis, job, async_op)


def _check_gather_out(out: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor, dim: int, ndim: int) -> None:
    if dim not in (0, -ndim) and ndim > 0:
        raise ValueError(f"all_gather out= gathers along dim 0 only, got dim={dim}; gather without out= (a new "
                         "tensor) or move the dimension first")
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"all_gather out= must be a contiguous {x.dtype} tensor of shape {list(shape)} on "
                         f"{x.device}, got {'a non-contiguous ' if not out.is_contiguous() else ''}{out.dtype} "
                         f"{list(out.shape)} on {out.device}; allocate it with torch.empty({list(shape)})")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``b`` is exactly the elements of the contiguous 1-D ``a`` (same start, count, dtype, layout)."""
    return (b.is_contiguous() and a.numel() == b.numel() and a.dtype == b.dtype and a.device == b.device
            and a.data_ptr() == b.data_ptr())


def _native_all_gather(flat: torch.Tensor, x: torch.Tensor, rows: list[int], inner: int,
                       group: dist.ProcessGroup, async_op: bool,
                       finish: Callable[[], torch.Tensor]) -> torch.Tensor | Handle:
    if x.device.type == "cpu" and flat.numel() and x.numel() and flat.data_ptr() <= x.data_ptr() < (
            flat.data_ptr() + flat.numel() * flat.element_size()):
        # gathering in place (out= with this rank's slice as the input): NCCL documents that case, gloo does
        # not promise it copes with its input inside its output, so it gets its own copy of the input
        x = x.clone()
    if len(set(rows)) == 1:
        work = gather_into_tensor(flat, x.reshape(-1), group=group, async_op=async_op)
        return Handle(work=work, finish=finish) if async_op else finish()
    # Uneven: gather rows padded to the largest share, then drop the padding.
    pad = max(rows) * inner
    mine = torch.zeros(pad, dtype=x.dtype, device=x.device)
    mine[:x.numel()].copy_(x.reshape(-1))
    gathered = torch.empty(pad * len(rows), dtype=x.dtype, device=x.device)
    work = gather_into_tensor(gathered, mine, group=group, async_op=async_op)

    def compact() -> torch.Tensor:
        pos = 0
        for j, r in enumerate(rows):
            flat[pos:pos + r * inner].copy_(gathered[j * pad:j * pad + r * inner])
            pos += r * inner
        return finish()
    return Handle(work=work, finish=compact) if async_op else compact()


def _cumsum(sizes: Sequence[int]) -> list[int]:
    out = [0]
    for s in sizes:
        out.append(out[-1] + s)
    return out


def reduce_scatter(t: torch.Tensor, mesh: Mesh, axis: str, *, op: str = "sum", dim: int = 0,
                   algorithm: str = "native", async_op: bool = False,
                   piece_bytes: int = DEFAULT_PIECE_BYTES, scratch: bool = False) -> torch.Tensor | Handle:
    """Reduce ``t`` across ``axis`` and return this rank's shard along ``dim`` (rows per ``shard_sizes``).
    ``t`` is not modified, unless ``scratch``: the caller gives ``t`` up and the reduction works in it, not in a
    ``t``-sized copy (the shard may be a view of ``t``). Conjugate of ``all_gather``. Collective."""
    check_algorithm(algorithm, ALGORITHM_CHOICES, "reduce_scatter")
    check_op(op, t.dtype)
    algorithm = resolve_algorithm(algorithm, mesh, axis, "reduce_scatter", t.numel() * t.element_size(), t.dtype)
    check_dtype(t.dtype, algorithm)
    n, i = mesh.size(axis), mesh.coord(axis)
    x = _rows_first(t, dim)
    record_collective("reduce_scatter", algorithm, axis, x.numel() * x.element_size(), n)
    if mesh.debug:
        check_agreement(mesh, axis, "reduce_scatter", x, op=op, algorithm=algorithm)
    rows = shard_sizes(x.shape[0], n)
    inner = math.prod(x.shape[1:])
    offsets = [r * inner for r in _cumsum(rows)]

    def shaped(flat_shard: torch.Tensor) -> torch.Tensor:
        out = flat_shard.reshape((rows[i], *x.shape[1:]))
        return out.movedim(0, dim) if t.dim() > 0 and dim not in (0, -t.dim()) else out

    if algorithm == "shm":  # reads the input in place (a copy only when the caller may change it meanwhile)
        group, src = _shm_group(mesh, axis, t), x.reshape(-1).clone() if async_op and not scratch else x.reshape(-1)

        def shm_job() -> torch.Tensor:
            if group is None:
                return shaped(src.clone())
            return shaped(group.reduce_scatter(src, op, offsets, piece_bytes))
        return _run(mesh, axis, shm_job, async_op)
    buf = x.reshape(-1) if scratch and x.is_contiguous() else x.reshape(-1).clone()
    if algorithm == "native":
        return _native_reduce_scatter(buf, rows, inner, i, op, mesh.group(axis), async_op, shaped)
    link = link_for(mesh, axis)

    def job() -> torch.Tensor:
        algo = ring_reduce_scatter if algorithm == "ring" else tree_reduce_scatter
        shard = algo(buf, link, op, offsets, piece_bytes) if algorithm == "ring" else algo(buf, link, op, offsets)
        return shaped(shard)
    return _run(mesh, axis, job, async_op)


def _native_reduce_scatter(buf: torch.Tensor, rows: list[int], inner: int, i: int, op: str,
                           group: dist.ProcessGroup, async_op: bool,
                           shaped: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | Handle:
    n, pad = len(rows), max(rows) * inner
    if len(set(rows)) != 1:  # uneven: lay every rank's chunk out padded to the largest share
        padded = torch.zeros(n * pad, dtype=buf.dtype, device=buf.device)
        for j, off in enumerate(_cumsum([r * inner for r in rows])[:-1]):
            padded[j * pad:j * pad + rows[j] * inner].copy_(buf[off:off + rows[j] * inner])
        buf = padded
    out = torch.empty(pad, dtype=buf.dtype, device=buf.device)
    work = reduce_scatter_into_tensor(out, buf, op=_native_op(op), group=group, async_op=async_op)

    def finish() -> torch.Tensor:
        shard = out[:rows[i] * inner]
        if op == "avg":
            shard.div_(n)
        return shaped(shard)
    return Handle(work=work, finish=finish) if async_op else finish()


def broadcast(t: torch.Tensor, mesh: Mesh, axis: str, *, src: int = 0, algorithm: str = "native",
              async_op: bool = False, piece_bytes: int = DEFAULT_PIECE_BYTES) -> torch.Tensor | Handle:
    """Copy the tensor of the rank at coordinate ``src`` along ``axis`` into every rank's ``t`` (in place)."""
    check_algorithm(algorithm, ALGORITHM_CHOICES, "broadcast")
    algorithm = resolve_algorithm(algorithm, mesh, axis, "broadcast", t.numel() * t.element_size(), t.dtype)
    check_dtype(t.dtype, algorithm)
    n = mesh.size(axis)
    if not 0 <= src < n:
        raise ValueError(f"broadcast src {src} is not a coordinate of axis {axis!r} (size {n}); use 0..{n - 1}")
    record_collective("broadcast", algorithm, axis, t.numel() * t.element_size(), n)
    if mesh.debug:
        check_agreement(mesh, axis, "broadcast", t, algorithm=algorithm, sizes=[src])
    flat = t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1)

    def finish() -> torch.Tensor:
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(flat.view(t.shape))
        return t

    if algorithm == "native":
        work = dist.broadcast(flat, src=mesh.global_rank(axis, src), group=mesh.group(axis), async_op=async_op)
        return Handle(work=work, finish=finish) if async_op else finish()
    if algorithm == "shm":
        return _shm_run(mesh, axis, t, lambda g: g.broadcast(flat, src, piece_bytes), finish, async_op)
    link = link_for(mesh, axis)

    def job() -> torch.Tensor:
        (ring_broadcast if algorithm == "ring" else tree_broadcast)(flat, link, src, piece_bytes)
        return finish()
    return _run(mesh, axis, job, async_op)


def all_to_all(t: torch.Tensor, mesh: Mesh, axis: str, *, split_dim: int, concat_dim: int,
               concat_sizes: Sequence[int] | None = None, algorithm: str = "native") -> torch.Tensor:
    """Cut ``t`` along ``split_dim`` into one piece per rank (``shard_sizes``), send piece ``j`` to rank
    ``j``, and concatenate the received pieces along ``concat_dim``. ``concat_sizes[j]`` is rank ``j``'s
    size along ``concat_dim`` when they differ. This is the S(concat_dim) → S(split_dim) boxing. Collective."""
    check_algorithm(algorithm, ("native",), "all_to_all")
    n, i = mesh.size(axis), mesh.coord(axis)
    d = t.dim()
    split_dim, concat_dim = split_dim % d, concat_dim % d
    csz = list(concat_sizes) if concat_sizes is not None else [t.shape[concat_dim]] * n
    record_collective("all_to_all", algorithm, axis, t.numel() * t.element_size(), n)
    if mesh.debug:
        check_agreement(mesh, axis, "all_to_all", t, algorithm=algorithm, sizes=csz)
    pieces = [p.contiguous() for p in torch.split(t, shard_sizes(t.shape[split_dim], n), dim=split_dim)]
    in_flat = torch.cat([p.reshape(-1) for p in pieces])
    recv_shapes = []
    for j in range(n):
        shape = list(pieces[i].shape)
        shape[concat_dim] = csz[j] if concat_dim != split_dim else shape[concat_dim]
        recv_shapes.append(shape)
    out_flat = torch.empty(sum(math.prod(s) for s in recv_shapes), dtype=t.dtype, device=t.device)
    dist.all_to_all_single(out_flat, in_flat, output_split_sizes=[math.prod(s) for s in recv_shapes],
                           input_split_sizes=[p.numel() for p in pieces], group=mesh.group(axis))
    parts = torch.split(out_flat, [math.prod(s) for s in recv_shapes])
    return torch.cat([p.view(s) for p, s in zip(parts, recv_shapes)], dim=concat_dim)


def send(t: torch.Tensor, mesh: Mesh, axis: str, *, dst: int, tag: int = 0) -> None:
    """Send ``t`` to the rank at coordinate ``dst`` along ``axis`` (blocking). Pairs with ``recv``."""
    h = isend(t, mesh, axis, dst=dst, tag=tag)
    h.wait()


def recv(t: torch.Tensor, mesh: Mesh, axis: str, *, src: int, tag: int = 0) -> torch.Tensor:
    """Receive into ``t`` from the rank at coordinate ``src`` along ``axis`` (blocking); returns ``t``."""
    return irecv(t, mesh, axis, src=src, tag=tag).wait()


def isend(t: torch.Tensor, mesh: Mesh, axis: str, *, dst: int, tag: int = 0) -> Handle:
    """Start sending ``t`` (kept alive until ``wait``) to coordinate ``dst`` along ``axis``."""
    n = mesh.size(axis)
    if not 0 <= dst < n or dst == mesh.coord(axis):
        raise ValueError(f"send dst {dst} must be another coordinate of axis {axis!r} (size {n}, this rank "
                         f"is {mesh.coord(axis)})")
    record_collective("send", "native", axis, t.numel() * t.element_size(), n)
    x = t.contiguous()
    work = link_for(mesh, axis).isend(x, dst, tag)
    return Handle(work=work, finish=lambda: x) if work is not None else Handle(finish=lambda: x)


def irecv(t: torch.Tensor, mesh: Mesh, axis: str, *, src: int, tag: int = 0) -> Handle:
    """Start receiving into ``t`` from coordinate ``src`` along ``axis``; ``wait()`` returns ``t``."""
    n = mesh.size(axis)
    if not 0 <= src < n or src == mesh.coord(axis):
        raise ValueError(f"recv src {src} must be another coordinate of axis {axis!r} (size {n}, this rank "
                         f"is {mesh.coord(axis)})")
    record_collective("recv", "native", axis, t.numel() * t.element_size(), n)
    x = t if t.is_contiguous() else torch.empty_like(t, memory_format=torch.contiguous_format)

    def finish() -> torch.Tensor:
        if x is not t:
            t.copy_(x)
        return t
    work = link_for(mesh, axis).irecv(x, src, tag)
    return Handle(work=work, finish=finish) if work is not None else Handle(finish=finish)


def barrier(mesh: Mesh, axis: str) -> None:
    """Wait until every rank of the axis group arrives. Collective."""
    dist.barrier(group=mesh.group(axis))
