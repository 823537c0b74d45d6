"""Asynchronous tensor parallelism: the tp collectives of the column and row layers cut into pieces that travel
while the matmuls of other pieces run (``parallelize(..., async_tp=True)``).

With sequence parallelism (``n`` = tp size, ``c`` = this rank's tp coordinate, chunk ``j`` = rank ``j``'s piece
of the sequence under ``shard_sizes``, uneven pieces allowed):

* ``gather_linear`` (column layer, all-gather → matmul). ``n`` steps; at step ``s`` this rank holds chunk
  ``(c − s) mod n``, posts its send to rank ``c+1`` and the receive of the next chunk from ``c−1``, then
  computes that chunk's rows of ``y = x·Wᵀ + b``: hop ``s`` hides under matmul ``s`` (``n`` matmuls, ``n−1``
  hops). The gathered input (b, t, i) is an output too: other column layers reading the same tensor (q, k, v;
  gate, up) reuse it, and their input gradients flow back through it. Backward: the input gradient's
  reduce-scatter as a ring of partial sums — at step ``s`` this rank computes chunk ``(c − s − 1) mod n`` of
  ``dY·W`` (plus the other readers' gradient), adds the accumulator received from ``c−1``, sends it on to
  ``c+1``, then runs that chunk's share of ``dW`` while it travels: hop ``s`` hides under the dW matmul of
  step ``s`` and the partial matmul of step ``s+1``; the accumulator ending at its owner after ``n−1`` hops is
  this rank's input gradient.
* ``linear_scatter`` (row layer, matmul → reduce-scatter): the same ring of partial sums on ``x·Wᵀ`` in the
  forward; backward all-gathers ``dY`` chunk by chunk (as ``gather_linear``'s forward), computing each chunk's
  ``dX`` rows and ``dW`` share while the next chunk travels.

Without sequence parallelism:

* ``linear_allreduce`` (row layer): ``y = x·Wᵀ`` in ``k = max(n, 2)`` pieces of the (b·t) rows; the all-reduce of
  piece ``j`` runs asynchronously while piece ``j+1``'s matmul runs. The last piece's all-reduce stays exposed.
* ``allreduce_grad_linear`` (column layer): forward plain; backward launches the input gradient's all-reduce
  asynchronously and computes the weight (and bias) gradient under it (Megatron-LM's overlap).

Transport: every hop is a point-to-point message on the tp axis' p2p group (gloo on CPU ranks, NCCL on CUDA),
or on the axis' shared-memory link for ``algorithm="shm"`` (``shm_p2p.ShmLink``); the piecewise all-reduces
use the collective ``algorithm`` with ``async_op=True``. A ring moves exactly the bytes of the ring all-gather
or reduce-scatter it replaces, (n−1)/n of the gathered tensor per rank. Values equal the unoverlapped path up
to the order of floating-point sums (chunked matmuls and accumulators).

Autocast (bf16): the wrappers cast the weights (and the row layers' inputs) as ``F.linear`` would and run the
Functions with autocast off; a column layer's input travels, and its gradient is summed, in the input's own
dtype, as on the unoverlapped path (which gathers before autocast's cast and reduces after its cast back).

CUDA (written, never run: the tests use CPU ranks): each hop's send and receive are posted as one
``batch_isend_irecv`` (one NCCL group, so at tp 2, where both directions share one communicator and stream, no
rank's send waits behind its own receive); NCCL p2p runs on its own stream, ``Work.wait()`` makes the current
stream wait for it, and every buffer in flight stays referenced (``_Ring.inflight``) until its wait.

Shared memory (``algorithm="shm"``): ``ShmLink`` copies a message that fits its channel in on the sender's thread
when posted and out on the receiver's thread when waited for, so the copies do not overlap the matmuls; only
the wait for a slower peer does.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.nn.functional as F

import torch.distributed as dist

from ...comm.collectives import all_reduce, link_for
from ...comm.counter import record_collective, record_message
from ...comm.ops import shard_offsets, shard_sizes
from ...mesh import Mesh

__all__ = ["gather_linear", "linear_scatter", "linear_allreduce", "allreduce_grad_linear", "piece_count"]

_FWD_TAG, _BWD_TAG = 7401, 7402
"""Message tags of the rings (distinct from the collectives' algorithms sharing the p2p group)."""


def piece_count(n: int) -> int:
    """Pieces of the chunked all-reduce of a row layer without sequence parallelism at tp size ``n``. Pure."""
    return max(n, 2)


class _Ring:
    """This rank's neighbours on the tp axis and its transport; ``shift`` posts one hop and keeps the buffers
    alive until ``wait``."""

    def __init__(self, mesh: Mesh, axis: str, algorithm: str) -> None:
        self.n, self.c = mesh.size(axis), mesh.coord(axis)
        if self.n == 1:
            self.link: Any = None
        elif algorithm == "shm":
            from ...comm.shm_p2p import shm_link_for
            self.link = shm_link_for(mesh, axis, what="async tensor parallelism over shm",
                                     fix="use algorithm='native' (or 'ring') for the tp collectives")
        else:
            self.link = link_for(mesh, axis)
        self.inflight: list = []

    def shift(self, send: torch.Tensor, recv: torch.Tensor | None, tag: int) -> None:
        """Post ``send`` to coordinate c+1 and the receive of ``recv`` from c−1 (not waited)."""
        nxt, prv = (self.c + 1) % self.n, (self.c - 1) % self.n
        if not hasattr(self.link, "group"):  # the shared-memory link
            works = [self.link.isend(send, nxt, tag)]
            if recv is not None:
                works.append(self.link.irecv(recv, prv, tag))
        else:
            works = self._batched(send, recv, nxt, prv, tag)
        self.inflight.append(([w for w in works if w is not None], send, recv))

    def _batched(self, send: torch.Tensor, recv: torch.Tensor | None, nxt: int, prv: int, tag: int) -> list:
        """The send and the receive posted as one batch: under NCCL both then run in one group, so at tp 2 (one
        communicator and stream for the pair) neither rank's send waits behind its own unposted receive."""
        ops = []
        for t, op, peer in ((send, dist.isend, nxt), (recv, dist.irecv, prv)):
            if t is None or t.numel() == 0:
                continue
            assert t.is_contiguous(), "ring hops move contiguous tensors"
            record_message(t.numel() * t.element_size(), sent=op is dist.isend)
            ops.append(dist.P2POp(op, t.reshape(-1).view(torch.uint8), self.link.ranks[peer],
                                  group=self.link.group, tag=tag))
        return list(dist.batch_isend_irecv(ops)) if ops else []

    def wait(self) -> None:
        for works, _send, _recv in self.inflight:
            for w in works:
                w.wait()
        self.inflight.clear()


def _chunks(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """(b, t, ...) → contiguous (b, t_j, ...) pieces along dim 1."""
    return [p.contiguous() for p in torch.split(x, sizes, dim=1)]


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.size(-1))


def _rows_mm(a: torch.Tensor, rows: slice, w: torch.Tensor, out: torch.Tensor | None = None,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``a[:, rows] @ w (+ bias)`` one batch element at a time: ``a[j, rows]`` is a contiguous (t_rows, k) block
    of a contiguous (b, t, k) tensor, so no slice is copied. a (b, t, k), w (k, m) → (b, t_rows, m), or written
    into ``out`` (each ``out[j]`` contiguous)."""
    n = rows.stop - rows.start
    if out is None:
        out = a.new_empty((a.size(0), n, w.size(1)))
    for j in range(a.size(0)):
        if bias is None:
            torch.mm(a[j, rows], w, out=out[j])
        else:
            torch.addmm(bias, a[j, rows], w, out=out[j])
    return out


def _add_weight_grad(dw: torch.Tensor, dy: torch.Tensor, dy_rows: slice, x: torch.Tensor, x_rows: slice) -> None:
    """``dw += Σ_j dy[j, dy_rows]ᵀ · x[j, x_rows]``: one sequence chunk's share of a weight gradient, without
    copying the slices (x cast to dw's dtype under autocast). dy (b, ·, o), x (b, ·, i), dw (o, i)."""
    for j in range(dy.size(0)):
        dw.addmm_(dy[j, dy_rows].t(), x[j, x_rows].to(dw.dtype))


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run a linear layer in here, or None (autocast off, or a non-float input)."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if x.is_floating_point() and torch.is_autocast_enabled(dev) else None


@contextlib.contextmanager
def _autocast_off(x: torch.Tensor) -> Iterator[None]:
    """Run a Function with autocast off: its wrapper already cast what ``F.linear`` under autocast would."""
    if torch.is_autocast_enabled(x.device.type):
        with torch.autocast(x.device.type, enabled=False):
            yield
    else:
        yield


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None else t.to(dtype)


class _GatherLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mesh: Mesh, axis: str,
                sizes: list[int], algorithm: str) -> tuple[torch.Tensor, torch.Tensor]:
        # x (b, t_c, i) this rank's chunk; w (o_r, i); returns y (b, t, o_r) and the gathered x (b, t, i)
        ring = _Ring(mesh, axis, algorithm)
        n, c = ring.n, ring.c
        record_collective("all_gather", f"async-{algorithm}", axis, x.numel() * x.element_size(), n)
        held = {c: x.contiguous()}
        offs = shard_offsets(sum(sizes), n)
        # (b, t, o_r), filled chunk by chunk, in the weight's dtype (autocast's: the chunks travel in x's dtype)
        y = x.new_empty((x.size(0), sum(sizes), w.size(0)), dtype=w.dtype)
        wt = w.t()  # (i, o_r)
        for s in range(n):
            src = (c - s) % n
            if s < n - 1:  # the chunk in hand goes on while its rows are computed
                nxt_src = (c - s - 1) % n
                held[nxt_src] = x.new_empty((x.size(0), sizes[nxt_src], *x.shape[2:]))
                ring.shift(held[src], held[nxt_src], _FWD_TAG)
            rows = slice(offs[src], offs[src] + sizes[src])
            _rows_mm(held[src].to(w.dtype), slice(0, sizes[src]), wt, y[:, rows], b)
            ring.wait()
        full = torch.cat([held[j] for j in range(n)], dim=1)
        ctx.save_for_backward(full, w)
        ctx.set_materialize_grads(False)  # no zeros for an unused gathered input
        ctx.has_bias, ctx.mesh, ctx.axis, ctx.sizes, ctx.algorithm = b is not None, mesh, axis, sizes, algorithm
        return y, full

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dfull: torch.Tensor | None) -> tuple:
        full, w = ctx.saved_tensors
        dx, dw = _scatter_ring(dy, w, full, dfull, ctx.mesh, ctx.axis, ctx.sizes, ctx.algorithm, _BWD_TAG,
                               weight_grad=ctx.needs_input_grad[1], acc_dtype=full.dtype)
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None


def _scatter_ring(dy: torch.Tensor, w: torch.Tensor, xin: torch.Tensor | None, extra: torch.Tensor | None,
                  mesh: Mesh, axis: str, sizes: list[int], algorithm: str, tag: int, *,
                  weight_grad: bool, transpose_w: bool = False, acc_dtype: torch.dtype | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Ring reduce-scatter over dim 1 of ``P = dy·w (+ extra)``, one chunk's matmul per step; with
    ``weight_grad``, ``dW = Σ_j dy_jᵀ·xin_j`` computed chunk by chunk while each accumulator travels.

    Shapes (backward of the column layer): dy (b, t, o_r), w (o_r, i), xin (b, t, i) → (b, t_c, i), dW (o_r, i).
    ``transpose_w`` (the row layer's forward): dy is its input x (b, t, i_r), w (o, i_r), P = x·wᵀ (b, t, o),
    no weight gradient. ``acc_dtype``: the partial sums' dtype when it differs from the matmul's (autocast: the
    gathered input's, as the unoverlapped path reduce-scatters the gradient after autocast's cast back)."""
    ring = _Ring(mesh, axis, algorithm)
    n, c = ring.n, ring.c
    offs = shard_offsets(sum(sizes), n)
    dy = dy.contiguous()
    xin = xin.contiguous() if xin is not None else None
    dw = torch.zeros_like(w) if weight_grad else None
    acc: torch.Tensor | None = None
    for s in range(n):
        d = (c - s - 1) % n  # the destination chunk whose partial sum this rank adds at step s
        rows = slice(offs[d], offs[d] + sizes[d])
        part = _rows_mm(dy, rows, w.t() if transpose_w else w)
        if acc_dtype is not None and part.dtype != acc_dtype:
            part = part.to(acc_dtype)
        if extra is not None:
            part = part + extra[:, rows]
        ring.wait()  # the accumulator for chunk d, sent by c−1 at step s−1, has arrived in ``acc``
        if acc is not None:
            part = part.add_(acc)
        if s < n - 1:
            acc = part.new_empty((part.size(0), sizes[(d - 1) % n], *part.shape[2:]))
            ring.shift(part, acc, tag)
        if dw is not None:  # this chunk's share of dW hides the hop just posted
            _add_weight_grad(dw, dy, rows, xin, rows)  # type: ignore[arg-type]
        if s == n - 1:
            ring.wait()
            return part, dw
    raise AssertionError("unreachable")


def _gather_ring(dy: torch.Tensor, w: torch.Tensor, x: torch.Tensor, mesh: Mesh, axis: str, sizes: list[int],
                 algorithm: str, tag: int, weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Backward of the row layer: all-gather of dy (b, t_c, o) chunk by chunk over the ring; each chunk's
    rows of dX = dY·w (w (o, i_r); dX (b, t, i_r)) and its share of dW = Σ_j dY_jᵀ·x_j (o, i_r) are computed
    while the next chunk travels."""
    ring = _Ring(mesh, axis, algorithm)
    n, c = ring.n, ring.c
    offs = shard_offsets(sum(sizes), n)
    held = {c: dy.contiguous()}
    x = x.contiguous()
    dx = dy.new_empty((dy.size(0), sum(sizes), w.size(1)))  # (b, t, i_r), filled chunk by chunk
    dw = torch.zeros_like(w) if weight_grad else None
    for s in range(n):
        src = (c - s) % n
        if s < n - 1:
            nxt = (c - s - 1) % n
            held[nxt] = dy.new_empty((dy.size(0), sizes[nxt], *dy.shape[2:]))
            ring.shift(held[src], held[nxt], tag)
        rows = slice(offs[src], offs[src] + sizes[src])
        _rows_mm(held[src], slice(0, sizes[src]), w, dx[:, rows])
        if dw is not None:
            _add_weight_grad(dw, held[src], slice(0, sizes[src]), x, rows)
        ring.wait()
    return dx, dw


class _LinearScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, mesh: Mesh, axis: str, algorithm: str) -> torch.Tensor:
        # x (b, t, i_r), w (o, i_r) → this rank's chunk of Σ_r x_r·W_rᵀ: (b, t_c, o)
        n = mesh.size(axis)
        sizes = shard_sizes(x.size(1), n)
        out_bytes = x.size(0) * x.size(1) * w.size(0) * x.element_size()
        record_collective("reduce_scatter", f"async-{algorithm}", axis, out_bytes, n)
        y, _ = _scatter_ring(x, w, None, None, mesh, axis, sizes, algorithm, _FWD_TAG, weight_grad=False,
                             transpose_w=True)
        ctx.save_for_backward(x, w)
        ctx.mesh, ctx.axis, ctx.sizes, ctx.algorithm = mesh, axis, sizes, algorithm
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        record_collective("all_gather", f"async-{ctx.algorithm}", ctx.axis, dy.numel() * dy.element_size(),
                          ctx.mesh.size(ctx.axis))
        dx, dw = _gather_ring(dy, w, x, ctx.mesh, ctx.axis, ctx.sizes, ctx.algorithm, _BWD_TAG,
                              ctx.needs_input_grad[1])
        return dx, dw, None, None, None


class _LinearAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, mesh: Mesh, axis: str, algorithm: str) -> torch.Tensor:
        # x (b, t, i_r), w (o, i_r) → Σ_r x_r·W_rᵀ (b, t, o), in pieces of the b·t rows
        rows = _flat(x)
        sizes = shard_sizes(rows.size(0), piece_count(mesh.size(axis)))
        handles, outs = [], []
        for piece in torch.split(rows, sizes, dim=0):
            out = F.linear(piece, w)  # (rows_j, o): reduced while the next piece's matmul runs
            outs.append(out)
            if out.numel():
                handles.append(all_reduce(out, mesh, axis, algorithm=algorithm, async_op=True))
        for h in handles:
            h.wait()
        ctx.save_for_backward(x, w)
        return torch.cat(outs, dim=0).view(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        x, w = ctx.saved_tensors
        dx = torch.matmul(dy, w)  # (b, t, o) @ (o, i_r)
        dw = _flat(dy).t() @ _flat(x) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


class _AllReduceGradLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mesh: Mesh, axis: str,
                algorithm: str) -> tuple[torch.Tensor, torch.Tensor]:
        # x (b, t, i) replicated, w (o_r, i) → y (b, t, o_r) and x itself for the group's other readers
        ctx.save_for_backward(x, w)
        ctx.set_materialize_grads(False)
        ctx.has_bias, ctx.mesh, ctx.axis, ctx.algorithm = b is not None, mesh, axis, algorithm
        return F.linear(x.to(w.dtype), w, b), x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, dother: torch.Tensor | None) -> tuple:
        x, w = ctx.saved_tensors
        dx = torch.matmul(dy, w).to(x.dtype)  # (b, t, o_r) @ (o_r, i): a partial sum over tp
        if dother is not None:
            dx = dx + dother
        handle = all_reduce(dx, ctx.mesh, ctx.axis, algorithm=ctx.algorithm, async_op=True)
        dw = _flat(dy).t() @ _flat(x).to(w.dtype) if ctx.needs_input_grad[1] else None  # hides the all-reduce
        db = dy.sum(dim=tuple(range(dy.dim() - 1))) if ctx.has_bias and ctx.needs_input_grad[2] else None
        handle.wait()
        return dx, dw, db, None, None, None


def gather_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mesh: Mesh, axis: str, *,
                  sizes: list[int], algorithm: str = "native") -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(all_gather(x, dim=1), w, b), all_gather(x, dim=1))`` with the gather's hops overlapped with
    the chunk matmuls; backward reduce-scatters the input gradient the same way. ``x`` (b, t_c, i) this rank's
    sequence chunk, ``sizes`` every rank's chunk length; ``w`` (o_r, i). Collective over ``axis``."""
    cdt = _autocast_dtype(x)  # under autocast: the weights cast as F.linear would; x travels in its own dtype
    w, b = _cast(w, cdt), _cast(b, cdt)
    with _autocast_off(x):
        return _GatherLinear.apply(x, w, b, mesh, axis, list(sizes), algorithm)


def linear_scatter(x: torch.Tensor, w: torch.Tensor, mesh: Mesh, axis: str, *,
                   algorithm: str = "native") -> torch.Tensor:
    """``reduce_scatter(F.linear(x, w), dim=1)`` with the chunk matmuls overlapped with the accumulators'
    hops; backward all-gathers the output gradient the same way. ``x`` (b, t, i_r), ``w`` (o, i_r) →
    (b, t_c, o). Collective over ``axis``."""
    cdt = _autocast_dtype(x)
    x, w = _cast(x, cdt), _cast(w, cdt)
    with _autocast_off(x):
        return _LinearScatter.apply(x, w, mesh, axis, algorithm)


def linear_allreduce(x: torch.Tensor, w: torch.Tensor, mesh: Mesh, axis: str, *,
                     algorithm: str = "native") -> torch.Tensor:
    """``all_reduce(F.linear(x, w))`` in ``piece_count(tp)`` row pieces, each piece's all-reduce running while the
    next piece's matmul runs; backward local. ``x`` (b, t, i_r), ``w`` (o, i_r) → (b, t, o). Collective."""
    cdt = _autocast_dtype(x)
    x, w = _cast(x, cdt), _cast(w, cdt)
    with _autocast_off(x):
        return _LinearAllReduce.apply(x, w, mesh, axis, algorithm)


def allreduce_grad_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, mesh: Mesh, axis: str, *,
                          algorithm: str = "native") -> tuple[torch.Tensor, torch.Tensor]:
    """``(F.linear(x, w, b), x)``; backward all-reduces the input gradient (plus the gradient reaching the
    returned alias of ``x`` from the group's other readers) asynchronously under the weight-gradient matmul.
    ``x`` (b, t, i) replicated, ``w`` (o_r, i). Collective over ``axis`` in backward."""
    cdt = _autocast_dtype(x)  # x stays in its dtype: its gradient is all-reduced in it, as unoverlapped
    w, b = _cast(w, cdt), _cast(b, cdt)
    with _autocast_off(x):
        return _AllReduceGradLinear.apply(x, w, b, mesh, axis, algorithm)
