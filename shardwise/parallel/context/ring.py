"""Ring attention: exact softmax attention over a sequence split along one mesh axis (``cp``).

Layout (causal load balancing, ``layout.py``): the global sequence is cut into ``2·cp`` chunks and cp rank ``i``
holds chunks ``i`` and ``2·cp−1−i``, so under a causal mask every rank does the same work. Forward: ``cp``
steps; at step ``j`` this rank holds the K/V block of rank ``(r − j) mod cp`` and has already posted the
transfer of that block to rank ``r+1`` (and the receive of the next one from ``r−1``) before computing on it,
so communication overlaps compute. Per (query chunk ``a``, key chunk ``c``): ``c < a`` full attention,
``c == a`` the causal diagonal, ``c > a`` skipped (without a mask every pair is full). Blocks merge with an
online softmax over a running log-sum-exp. Backward: the K/V blocks travel the ring again with their dK/dV
accumulators (``cp−1`` K/V hops, ``cp`` dK/dV hops, so each accumulator ends at its owner); each block's
probabilities are recomputed from the final log-sum-exp. Grouped-query attention: the ``hkv``-headed K/V
travel, are expanded locally, and dK/dV are summed back over each group before they travel.

Timing (``ring_timing``, off by default: one ``None`` check per wait and per pass): the seconds a rank spends in
the ring's passes, the seconds it is blocked waiting for a block or an accumulator (communication that
compute did not hide), and the bytes it sends — what ``shardwise bench cp`` reports.

Numerics: the log-sum-exp, the output and every gradient accumulate in fp32 (fp64 for fp64 inputs); the result
is cast to the inputs' dtype. Each block is computed by ``blocks.py``: plain math, or the fused CPU kernel.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import Tensor

from ...comm.collectives import irecv, isend
from ...comm.handles import Handle
from ...mesh import Mesh
from .blocks import FlashBlocks, MathBlocks, acc_dtype, select
from .documents import Documents, document_block_pairs

__all__ = ["ring_attention", "ring_timing", "RingTiming"]

_KV_TAG = 7301
_GRAD_TAG = 7302

Blocks = type[MathBlocks] | type[FlashBlocks]
Pair = tuple[slice, slice, slice, bool]
"""(batch rows, query rows, key rows, diagonal) of one block, in local coordinates."""


@dataclass
class RingTiming:
    """What ``ring_timing`` recorded on this rank: seconds inside the ring's forward and backward passes
    (compute and communication), seconds blocked in ``wait()`` (the exposed communication), bytes sent by
    ``kind`` (``kv``: K/V blocks, ``grad``: dK/dV accumulators) and ring passes (forward + backward)."""

    pass_s: float = 0.0
    wait_s: float = 0.0
    passes: int = 0
    sent: dict[str, int] = field(default_factory=lambda: {"kv": 0, "grad": 0})
    hops: dict[str, int] = field(default_factory=lambda: {"kv": 0, "grad": 0})


_TIMING: RingTiming | None = None


@contextlib.contextmanager
def ring_timing(into: RingTiming | None = None) -> Iterator[RingTiming]:
    """``with ring_timing() as t: ...``: record the ring's pass, wait and byte counts of this process (the
    thread running forward and backward) into ``t`` (or ``into``, to add to earlier counts)."""
    global _TIMING
    prev, _TIMING = _TIMING, into if into is not None else RingTiming()
    try:
        yield _TIMING
    finally:
        _TIMING = prev


@dataclass(frozen=True)
class _Ring:
    mesh: Mesh
    axis: str
    cp: int
    rank: int

    def source(self, step: int) -> int:
        """The cp coordinate whose K/V block this rank holds at ``step``."""
        return (self.rank - step) % self.cp

    def shift(self, send: Tensor, recv: Tensor, tag: int) -> list[Handle]:
        """Post ``send`` to the next rank and the receive of ``recv`` from the previous one (not waited)."""
        if self.cp == 1:
            recv.copy_(send)
            return []
        nxt, prv = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        if _TIMING is not None:
            kind = "kv" if tag == _KV_TAG else "grad"
            _TIMING.sent[kind] += send.numel() * send.element_size()
            _TIMING.hops[kind] += 1
        return [isend(send, self.mesh, self.axis, dst=nxt, tag=tag),
                irecv(recv, self.mesh, self.axis, src=prv, tag=tag)]


def _wait(handles: list[Handle]) -> None:
    if _TIMING is None or not handles:
        for h in handles:
            h.wait()
        return
    t = time.perf_counter()
    for h in handles:
        h.wait()
    _TIMING.wait_s += time.perf_counter() - t


@contextlib.contextmanager
def _timed_pass() -> Iterator[None]:
    timing = _TIMING
    if timing is None:
        yield
        return
    t = time.perf_counter()
    yield
    timing.pass_s += time.perf_counter() - t
    timing.passes += 1


def block_pairs(rank: int, src: int, cp: int, local_len: int, causal: bool) -> list[tuple[slice, slice, bool]]:
    """The blocks rank ``rank`` computes against the K/V of rank ``src``: local chunk 0 is global chunk
    ``rank`` (keys: ``src``), local chunk 1 is ``2·cp−1−rank`` (keys: ``2·cp−1−src``)."""
    if not causal:
        return [(slice(0, local_len), slice(0, local_len), False)]
    c = local_len // 2
    q_chunks, k_chunks = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    pairs = []
    for i, a in enumerate(q_chunks):
        for j, b in enumerate(k_chunks):
            if b <= a:
                pairs.append((slice(i * c, (i + 1) * c), slice(j * c, (j + 1) * c), b == a))
    return pairs


def _pairs(ring: "_Ring", step: int, local_len: int, causal: bool, documents: Documents | None) -> list[Pair]:
    """The blocks of ``step``: causal/full chunk pairs, or one rectangle per shared document (``documents.py``)."""
    if documents is None:  # every batch row alike
        return [(slice(None), *pair) for pair in block_pairs(ring.rank, ring.source(step), ring.cp, local_len, causal)]
    return document_block_pairs(ring.rank, ring.source(step), ring.cp, local_len, documents.spans)


def _pack(a: Tensor, b: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    return torch.cat([a.reshape(-1), b.reshape(-1)]).to(dtype or a.dtype)


def _unpack(buf: Tensor, a_shape: torch.Size, b_shape: torch.Size) -> tuple[Tensor, Tensor]:
    n = math.prod(a_shape)
    return buf[:n].view(a_shape), buf[n:].view(b_shape)


def _expand(t: Tensor, groups: int) -> Tensor:
    """(b, hkv, n, d) -> (b, hkv·groups, n, d): query head ``i`` reads K/V head ``i // groups`` (as SDPA's
    ``enable_gqa``)."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _reduce_groups(t: Tensor, groups: int) -> Tensor:
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.view(b, h // groups, groups, n, d).sum(2)


def _merge(out: Tensor, lse: Tensor, blk_out: Tensor, blk_lse: Tensor, bs: slice, rows: slice) -> None:
    """Online softmax: fold one block's (output, log-sum-exp) into the running ones of ``rows``, in place."""
    o, l = out[bs, :, rows], lse[bs, :, rows]
    new = torch.logaddexp(l, blk_lse)
    o.mul_(torch.exp(l - new).unsqueeze(-1)).add_(blk_out * torch.exp(blk_lse - new).unsqueeze(-1))
    l.copy_(new)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: _Ring, scale: float, causal: bool,
                  blocks: Blocks, documents: Documents | None = None) -> tuple[Tensor, Tensor]:
    b, h, sq, _ = q.shape
    groups = h // k.shape[1]
    acc = acc_dtype(q)
    # (b, h, sq, dv) stored token-major, as SDPA's CPU output: the model's ``transpose(1, 2).reshape`` of the
    # result is then a view, not one more copy of the layer's width kept for backward
    out = torch.zeros((b, sq, h, v.shape[-1]), dtype=acc, device=q.device).transpose(1, 2)
    lse = torch.full((b, h, sq), float("-inf"), dtype=acc, device=q.device)
    buf = _pack(k, v)
    for step in range(ring.cp):
        nxt, pending = None, []
        if step < ring.cp - 1:
            nxt = torch.empty_like(buf)
            pending = ring.shift(buf, nxt, _KV_TAG)  # posted before the compute it overlaps
        kc, vc = _unpack(buf, k.shape, v.shape)
        kf, vf = _expand(kc, groups), _expand(vc, groups)
        for bs, rows, cols, diag in _pairs(ring, step, sq, causal, documents):
            blk_out, blk_lse = blocks.forward(q[bs, :, rows], kf[bs, :, cols], vf[bs, :, cols], scale, diag)
            _merge(out, lse, blk_out, blk_lse, bs, rows)
        _wait(pending)
        if nxt is not None:
            buf = nxt
    return out, lse


def _block_grads(blocks: Blocks, saved: tuple[Tensor, ...], kc: Tensor, vc: Tensor, pairs: list[Pair], scale: float,
                 dq: Tensor) -> tuple[Tensor, Tensor]:
    """Accumulate this K/V block's share of dQ into ``dq``; return its (dK, dV) contributions (hkv heads).
    ``saved``: the local (q, dO, final output, final log-sum-exp, rowsum(dO ∘ O))."""
    q, do, out, lse, delta = saved
    groups = q.shape[1] // kc.shape[1]
    kf, vf = _expand(kc, groups), _expand(vc, groups)
    dk = torch.zeros(kf.shape, dtype=dq.dtype, device=dq.device)
    dv = torch.zeros(vf.shape, dtype=dq.dtype, device=dq.device)
    for bs, rows, cols, diag in pairs:
        gq, gk, gv = blocks.backward(do[bs, :, rows], q[bs, :, rows], kf[bs, :, cols], vf[bs, :, cols],
                                     out[bs, :, rows], lse[bs, :, rows], delta[bs, :, rows], scale, diag)
        dq[bs, :, rows] += gq
        dk[bs, :, cols] += gk
        dv[bs, :, cols] += gv
    return _reduce_groups(dk, groups), _reduce_groups(dv, groups)


def _ring_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, ring: _Ring,
                   scale: float, causal: bool, blocks: Blocks,
                   documents: Documents | None = None) -> tuple[Tensor, Tensor, Tensor]:
    acc = acc_dtype(q)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    saved = (q, dout, out, lse, delta)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    buf = _pack(k, v)
    grads_in: Tensor | None = None
    grads_pending: list[Handle] = []
    for step in range(ring.cp):
        nxt, pending = None, []
        if step < ring.cp - 1:
            nxt = torch.empty_like(buf)
            pending = ring.shift(buf, nxt, _KV_TAG)
        kc, vc = _unpack(buf, k.shape, v.shape)
        pairs = _pairs(ring, step, q.shape[2], causal, documents)
        local = _pack(*_block_grads(blocks, saved, kc, vc, pairs, scale, dq), dtype=acc)
        _wait(grads_pending)  # the accumulator of this block, from the ranks it visited before
        if grads_in is not None:
            local += grads_in
        grads_in = torch.empty_like(local)
        grads_pending = ring.shift(local, grads_in, _GRAD_TAG)  # on to the next rank; the last hop: home
        _wait(pending)
        if nxt is not None:
            buf = nxt
    _wait(grads_pending)
    assert grads_in is not None
    dk, dv = _unpack(grads_in, k.shape, v.shape)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: _Ring, scale: float,  # type: ignore[override]
                causal: bool, blocks: Blocks, documents: Documents | None) -> Tensor:
        with _timed_pass():
            out, lse = _ring_forward(q, k, v, ring, scale, causal, blocks, documents)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.causal, ctx.blocks, ctx.documents = ring, scale, causal, blocks, documents
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        with _timed_pass():
            dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, ctx.ring, ctx.scale, ctx.causal, ctx.blocks,
                                        ctx.documents)
        return dq, dk, dv, None, None, None, None, None


def _check(q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, axis: str, dropout_p: float) -> None:
    if dropout_p:
        raise ValueError(f"ring attention got dropout_p={dropout_p}; set dropout 0 with context parallelism")
    if axis not in mesh.axes:
        raise ValueError(f"ring attention: axis {axis!r} is not an axis of the mesh {mesh.axes}; pass axis= one of "
                         f"them")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"ring attention takes (batch, heads, seq, dim) tensors, got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, h, sq, d = q.shape
    if k.shape[0] != b or v.shape[:3] != k.shape[:3] or k.shape[-1] != d or k.shape[1] < 1 or h % k.shape[1]:
        raise ValueError(f"ring attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         f"match; k and v need q's batch and head dim, and heads dividing q's {h}")
    if k.shape[2] != sq or sq % 2:
        raise ValueError(f"ring attention needs equal query and key lengths holding two equal chunks, got "
                         f"{sq} and {k.shape[2]}; shard the sequence with shard_sequence (self-attention)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"ring attention: q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them alike")


def ring_attention(q: Tensor, k: Tensor, v: Tensor, mesh: Mesh, axis: str = "cp", *, causal: bool = True,
                   scale: float | None = None, dropout_p: float = 0.0, impl: str = "auto",
                   documents: Documents | None = None) -> Tensor:
    """Attention of the local queries ``q`` (b, h, s, d) over the whole sequence, whose K/V ``k``, ``v``
    (b, hkv, s, d), ``h % hkv == 0``, are split over ``axis`` in the balanced layout of ``shard_sequence``.
    Returns the local output (b, h, s, dv), equal to ``F.scaled_dot_product_attention`` on the full sequence
    (``is_causal=causal``, ``enable_gqa=True``) at this rank's positions. Collective over ``axis``; every
    rank calls it with the same shapes. ``dropout_p`` must be 0. ``impl``: how each block is computed, ``"math"``,
    ``"flash"`` (the fused CPU kernel) or ``"auto"`` (flash where it applies; ``blocks.py``). Under autocast the
    inputs are cast to the autocast dtype first, as SDPA's are. ``documents`` (``documents.py``, whole-row spans):
    causal attention within each document only, as ``document_attention`` on the whole sequence; block pairs of
    chunks that share no document are skipped."""
    _check(q, k, v, mesh, axis, dropout_p)
    if documents is not None and (documents.length != q.shape[2] * mesh.size(axis) or not causal):
        raise ValueError(f"ring attention: documents of rows of {documents.length} tokens for a local sequence of "
                         f"{q.shape[2]} over cp={mesh.size(axis)}; derive them from the whole rows, causal=True")
    device = q.device.type
    autocast = torch.is_autocast_enabled(device)
    if autocast:  # as SDPA under autocast: inputs in the autocast dtype; inside, the ring's own fp32 accumulators
        dtype = torch.get_autocast_dtype(device)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    blocks = select(impl, q, v)
    ring = _Ring(mesh, axis, mesh.size(axis), mesh.coord(axis))
    with torch.autocast(device, enabled=False) if autocast else contextlib.nullcontext():
        return _RingAttention.apply(q, k, v, ring, q.shape[-1] ** -0.5 if scale is None else float(scale), causal,
                                    blocks, documents)
