"""Tree collectives over point-to-point messages (latency-optimal).

A binary tree in heap order over *virtual* positions ``v = (index - root) % n`` (parent ``(v-1)//2``,
children ``2v+1`` and ``2v+2``). All-reduce = reduce up the tree to the root, then broadcast down: about
``2·log2(n)`` message latencies instead of the ring's ``2(n-1)``, at the cost of bandwidth (interior nodes
receive from two children). This is the single-tree variant; NCCL's double binary tree (Sanders, Speck &
Träff 2009, "Two-tree algorithms for full bandwidth broadcast, reduction and scan") runs two complementary
trees on halves of the data to recover bandwidth — a stretch goal here. Large buffers are pipelined in
pieces so a piece moves up (or down) while the next one is reduced.

All functions take flat, contiguous 1-D tensors and are collective over ``link``.
"""

from __future__ import annotations

import torch

from .ops import reduce_into
from .p2p import AxisLink, wait_all
from .ring import DEFAULT_PIECE_BYTES, _pieces, scratch

__all__ = ["tree_all_reduce", "tree_reduce", "tree_broadcast", "tree_all_gather", "tree_reduce_scatter"]


def _to_index(v: int, root: int, n: int) -> int:
    return (v + root) % n


def _children(v: int, n: int) -> list[int]:
    return [c for c in (2 * v + 1, 2 * v + 2) if c < n]


def _subtree(v: int, n: int) -> list[int]:
    """Virtual positions in the subtree rooted at ``v``, in heap (breadth-first) order."""
    out, frontier = [], [v]
    while frontier:
        out += frontier
        frontier = [c for u in frontier for c in _children(u, n)]
    return out


def tree_reduce(buf: torch.Tensor, link: AxisLink, op: str, root: int = 0,
                piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
    """Reduce every rank's ``buf`` into the root's ``buf`` (others' ``buf`` end up holding partial sums)."""
    n = link.size
    v = (link.index - root) % n
    kids = [_to_index(c, root, n) for c in _children(v, n)]
    spans = _pieces(0, buf.numel(), max(1, piece_bytes // buf.element_size()))
    # One reusable receive area for both children: (2, numel) rows of the shared scratch buffer.
    area = scratch(len(kids) * buf.numel(), buf.dtype, buf.device)
    bufs = [area[i * buf.numel():(i + 1) * buf.numel()] for i in range(len(kids))]
    recvs = [[link.irecv(s[a:b], k) for a, b in spans] for s, k in zip(bufs, kids)]
    parent = _to_index((v - 1) // 2, root, n) if v > 0 else None
    sends = []
    for p, (a, b) in enumerate(spans):
        for s, works in zip(bufs, recvs):
            if works[p] is not None:
                works[p].wait()
            reduce_into(buf[a:b], s[a:b], op)
        if parent is not None:
            sends.append(link.isend(buf[a:b], parent))
    wait_all(sends)


def tree_broadcast(buf: torch.Tensor, link: AxisLink, root: int = 0, piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
    """Broadcast the root's ``buf`` down the tree, piece by piece."""
    n = link.size
    v = (link.index - root) % n
    kids = [_to_index(c, root, n) for c in _children(v, n)]
    spans = _pieces(0, buf.numel(), max(1, piece_bytes // buf.element_size()))
    parent = _to_index((v - 1) // 2, root, n) if v > 0 else None
    recvs = [link.irecv(buf[a:b], parent) for a, b in spans] if parent is not None else [None] * len(spans)
    sends = []
    for (a, b), work in zip(spans, recvs):
        if work is not None:
            work.wait()
        sends += [link.isend(buf[a:b], k) for k in kids]
    wait_all(sends)


def tree_all_reduce(buf: torch.Tensor, link: AxisLink, op: str, piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
    """In-place all-reduce: reduce to position 0, then broadcast from it."""
    if link.size == 1:
        return
    tree_reduce(buf, link, op, 0, piece_bytes)
    if op == "avg" and link.index == 0:
        buf.div_(link.size)
    tree_broadcast(buf, link, 0, piece_bytes)


def _pack(buf: torch.Tensor, offsets: list[int], indices: list[int]) -> torch.Tensor:
    return torch.cat([buf[offsets[j]:offsets[j + 1]] for j in indices]) if indices else buf[:0]


def _unpack(packed: torch.Tensor, buf: torch.Tensor, offsets: list[int], indices: list[int]) -> None:
    pos = 0
    for j in indices:
        size = offsets[j + 1] - offsets[j]
        buf[offsets[j]:offsets[j + 1]].copy_(packed[pos:pos + size])
        pos += size


def tree_all_gather(out: torch.Tensor, link: AxisLink, offsets: list[int]) -> None:
    """``out`` holds this rank's chunk; gather every subtree's chunks up to position 0, then broadcast."""
    n = link.size
    if n == 1:
        return
    v = link.index  # root 0: virtual position == group position
    kid_trees = [(c, _subtree(c, n)) for c in _children(v, n)]
    packs = [torch.empty(sum(offsets[j + 1] - offsets[j] for j in tree), dtype=out.dtype, device=out.device)
             for _, tree in kid_trees]
    works = [link.irecv(p, c) for p, (c, _) in zip(packs, kid_trees)]
    for p, (c, tree), w in zip(packs, kid_trees, works):
        if w is not None:
            w.wait()
        _unpack(p, out, offsets, tree)
    if v > 0:
        wait_all([link.isend(_pack(out, offsets, _subtree(v, n)), (v - 1) // 2)])
    tree_broadcast(out, link, 0)


def tree_reduce_scatter(buf: torch.Tensor, link: AxisLink, op: str, offsets: list[int]) -> torch.Tensor:
    """Reduce ``buf`` (clobbered) to position 0, then scatter each subtree's chunks down; return own chunk."""
    n, v = link.size, link.index
    if n > 1:
        tree_reduce(buf, link, op, 0)
        if v > 0:
            mine = _subtree(v, n)
            pack = torch.empty(sum(offsets[j + 1] - offsets[j] for j in mine), dtype=buf.dtype, device=buf.device)
            wait_all([link.irecv(pack, (v - 1) // 2)])
            _unpack(pack, buf, offsets, mine)
        wait_all([link.isend(_pack(buf, offsets, _subtree(c, n)), c) for c in _children(v, n)])
    out = buf[offsets[v]:offsets[v + 1]]
    if op == "avg":
        out.div_(n)
    return out
