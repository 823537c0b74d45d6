"""Asynchronous tensor parallelism (``Layout.async_tp``): what stays of a layer's tensor-parallel communication
when every collective is cut into pieces that travel while matmuls run (the runtime's
``shardwise/parallel/tensor/overlap.py``; Megatron-Core's ``--tp-comm-overlap`` over Transformer Engine's
userbuffers and torchtitan's async TP do the same).

A layer's ``tp_allreduces`` collectives of its hidden state pair with its weight GEMMs in order: collective
``i`` with the ``i``-th column GEMM (whose input it gathers) and the ``i``-th row GEMM (whose output it reduces),
as a block's attention (qkv, proj) and MLP (fc, fc_proj). ``t`` is the tp size, a *chunk* ``1/t`` of the
micro-batch's token rows, ``h`` the matmul time a hop can hide under.

With sequence parallelism each all-reduce is an all-gather before the column GEMM and a reduce-scatter after
the row GEMM (the same bytes; each priced as half the all-reduce, as the unoverlapped term prices the pair). Each
runs as a ring of ``t − 1`` hops of one chunk; hop ``j`` travels while the matmul of another chunk runs, so a
ring exposes

    Σ over its t − 1 hops of  max(0, β_hop − s · h) + α_hop          (GPUs)
    Σ over its t − 1 hops of  (1 − s) · β_hop + max(0, α_hop + s · β_hop − h)   (CPU ranks)

where ``β_hop`` is the hop's transfer (the collective's bandwidth term over ``t − 1``) and ``α_hop`` its latency
(the collective's latency term over ``t − 1``; on a calibrated machine the measured alpha–beta model's, else the
link's), so that with nothing to hide under a ring costs exactly the collective it replaces. ``h`` is one
chunk's forward matmul in forward; in backward one chunk's input-gradient matmul plus its share of the
weight-gradient matmul (both run between two hops; a zero-bubble schedule defers the weight gradient, which then
hides nothing). ``s`` is the share of a hop's transfer that can run beside compute (``overlap_share``). On a GPU
the latency is the hop's fixed cost on the compute stream (launch, event wait) and stays exposed; on CPU ranks it
is waiting (for the peer, for the transport's thread to be scheduled), which compute runs through, while the copy
takes a core (``hop_exposed``).

Without sequence parallelism a row GEMM runs in ``p = max(t, 2)`` row pieces and the all-reduce of piece ``j``
travels under piece ``j + 1``'s matmul; the last piece's all-reduce stays exposed, and every piece pays the
collective's full latency. A column GEMM's input-gradient all-reduce travels under its weight-gradient matmul
(Megatron-LM's overlap). A collective with no GEMM to pair (an embedding's) stays whole and exposed.

What the overlap costs, counted with the exposed communication in ``tp_fwd`` / ``tp_bwd``:

- *decomposition*: a matmul cut into ``c`` row pieces costs ``c × gemm_time(piece) − gemm_time(whole)`` more —
  each piece is launched on its own and runs at its own (smaller) shape's efficiency; a ring step's chunk is
  one matmul per sequence of the micro-batch, as the runtime runs it (``GemmChunks.ring_piece``);
- *accumulation* (``IN_PLACE_PIECES``): the memory passes that assemble the pieces — a reduce-scatter ring adds
  the partial sum it receives to its own (three chunk-sized passes per hop), a gathered input is concatenated
  for backward, a weight gradient accumulated from pieces is zeroed first, a chunked all-reduce's pieces are
  concatenated;
- *contention*: on a GPU the communication kernels take streaming multiprocessors from the GEMM they overlap,
  which slows it by ``f / (1 − f)`` of the overlapped time (``GPU_COMM_SM_SHARE``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from .hardware import Hardware

__all__ = ["GPU_COMM_SM_SHARE", "H100_SMS", "IN_PLACE_PIECES", "in_place_pieces", "OverlapTime", "GemmChunks",
           "overlap_share", "split_collective", "hop_exposed", "ring_exposed", "chunked_allreduce_exposed", "decomposition",
           "layer_overlap"]

H100_SMS = 132
"""Streaming multiprocessors of an H100 SXM (NVIDIA H100 datasheet); the share below is counted against it."""

GPU_COMM_SM_SHARE: dict[str, float] = {"all_gather": 1 / H100_SMS, "reduce_scatter": 16 / H100_SMS,
                                       "all_reduce": 16 / H100_SMS}
"""Share of a GPU's multiprocessors a communication kernel takes from the GEMM it overlaps, per collective. Not
fitted: Transformer Engine's userbuffers defaults — the all-gather rings (``ring_exchange``) move their chunks
with the copy engines and one SM, the reduce-scatters (``pipeline`` / ``bulk``) run on 16 SMs (``num_sm=16``,
with the GEMM given the rest, ``set_sm_margin``) — counted against an H100's 132 SMs. An A100 (108 SMs) would
lose a little more; the presets share this one number (a stated assumption)."""


IN_PLACE_PIECES = False
"""How the runtime assembles the pieces. False (``shardwise/parallel/tensor/overlap.py`` today): the matmuls
write their rows into the output and accumulate the weight gradient in place (``out=``, ``addmm_``), but some
pieces take a kernel of their own — ``part.add_(acc)`` per reduce-scatter hop, ``torch.cat`` of the gathered
input (kept for backward) and of a chunked all-reduce's pieces, the zeroed weight gradient — and
``OverlapTime.accumulation`` prices those passes. True: none of them (the received partial sum accumulated by the
next GEMM, ``beta = 1``; the gathered input received into one buffer, as Transformer Engine's userbuffers do).
Read at call time; ``in_place_pieces()`` sets it for a what-if."""


@contextmanager
def in_place_pieces() -> Iterator[None]:
    """Price the pieces as assembled in place (``IN_PLACE_PIECES``) inside the ``with`` block."""
    global IN_PLACE_PIECES
    old, IN_PLACE_PIECES = IN_PLACE_PIECES, True
    try:
        yield
    finally:
        IN_PLACE_PIECES = old


@dataclass(frozen=True)
class OverlapTime:
    """Seconds one micro-batch's tensor-parallel communication costs in one direction under ``async_tp``."""

    exposed: float
    """Transfers and latencies no matmul hides (never more than the unoverlapped collectives on the link model)."""
    contention: float
    """The overlapped GEMMs' slowdown while communication kernels share the device."""
    decomposition: float
    """Extra matmul time of the row pieces (and the extra latencies of an all-reduce cut into pieces)."""
    accumulation: float = 0.0
    """Memory passes the pieces add: partial sums, weight-gradient pieces, concatenated outputs."""

    @property
    def total(self) -> float:
        return self.exposed + self.contention + self.decomposition + self.accumulation


@dataclass(frozen=True)
class GemmChunks:
    """One weight GEMM at its tensor-parallel shape: whole and per row piece, forward, input gradient and weight
    gradient (seconds, the calibration's block factors applied), as a callable of the piece count."""

    fwd: float
    dgrad: float
    wgrad: float
    piece: Callable[[int], tuple[float, float, float]]
    """``c`` → (forward, input-gradient, weight-gradient) seconds of one of ``c`` pieces of the micro-batch's
    rows, one matmul each (a chunked all-reduce's pieces)."""
    ring_piece: Callable[[int], tuple[float, float, float]]
    """The same for a ring step's chunk, ``1/c`` of every sequence's rows, which the runtime runs as one matmul
    per sequence of the micro-batch (each a contiguous block, no copy)."""
    in_bytes: float = 0.0
    """Its input (``m × k``) at the compute precision."""
    out_bytes: float = 0.0
    """Its output (``m × n``) at the compute precision."""
    weight_elems: float = 0.0
    """Elements of its weight shard (``k × n``): the weight gradient the pieces add into."""


def overlap_share(hw: Hardware, ranks_per_host: int) -> float:
    """Share of a hop that can travel beside compute. A GPU: all of it (its transfers run on copy engines or
    SMs of their own). CPU ranks: the host's cores move the bytes, so a hop only travels beside compute on cores
    no rank computes on — ``(cores − ranks) / ranks`` per rank, none when every core runs a rank."""
    if not hw.host_cores:
        return 1.0
    return min(1.0, max(0.0, (hw.host_cores - ranks_per_host) / max(ranks_per_host, 1)))


def _sm_share(hw: Hardware, op: str) -> float:
    return GPU_COMM_SM_SHARE[op] if not hw.host_cores else 0.0


def split_collective(coll: Callable[[str, float], float], op: str, nbytes: float) -> tuple[float, float]:
    """``(bandwidth, latency)`` seconds of one collective of ``nbytes``: the latency is what one byte costs
    (the alpha term of the link or of the calibration's model), the bandwidth term the rest."""
    total = coll(op, nbytes)
    latency = min(total, coll(op, 1.0))
    return total - latency, latency


def hop_exposed(beta: float, alpha: float, hide: float, share: float, latency_hides: bool) -> tuple[float, float]:
    """``(exposed, overlapped transfer)`` seconds of one hop of ``beta`` transfer and ``alpha`` latency beside
    ``hide`` seconds of matmul, ``share`` of the transfer able to travel beside compute.

    ``latency_hides`` False (GPUs): the latency is the hop's fixed cost on the compute stream (its launch, the wait
    on its event), always exposed: ``max(0, β − s·h) + α``. True (CPU ranks): the latency is waiting — for the
    peer, for the transport's own thread to be scheduled — and needs no core, so the matmul runs through it; the
    copy takes a core: ``(1 − s)·β + max(0, α + s·β − h)``. Either way, ``h = 0`` costs ``α + β``."""
    if latency_hides:
        return (1.0 - share) * beta + max(0.0, alpha + share * beta - hide), min(share * beta, hide)
    covered = min(beta, share * hide)
    return beta - covered + alpha, covered


def ring_exposed(bandwidth: float, latency: float, hops: int, hide: float, share: float, sm_share: float,
                 latency_hides: bool = False) -> tuple[float, float]:
    """``(exposed, contention)`` seconds of a collective run as ``hops`` ring hops, each beside ``hide``
    seconds of matmul (module doc, ``hop_exposed``). ``hide = 0``: exactly ``bandwidth + latency``."""
    exposed, covered = hop_exposed(bandwidth / hops, latency / hops, hide, share, latency_hides)
    return hops * exposed, hops * covered * sm_share / (1.0 - sm_share)


def chunked_allreduce_exposed(bandwidth: float, latency: float, pieces: int, hide: float, share: float,
                              sm_share: float, latency_hides: bool = False) -> tuple[float, float, float]:
    """``(exposed, contention, extra latency)`` of an all-reduce cut into ``pieces``, piece ``j``'s under piece
    ``j + 1``'s matmul (``hide`` seconds each): the last piece is exposed and every piece pays the full latency —
    one latency counted as exposed (as the whole all-reduce's), what the others add as the cost of cutting it."""
    beta = bandwidth / pieces
    exposed, covered = hop_exposed(beta, latency, hide, share, latency_hides)
    # the part of a piece's exposure its latency adds (all of it on a GPU): the price of cutting, not transfer
    extra = exposed - hop_exposed(beta, 0.0, hide, share, latency_hides)[0]
    return ((pieces - 1) * (exposed - extra) + beta + latency, (pieces - 1) * covered * sm_share / (1.0 - sm_share),
            (pieces - 1) * extra)


def decomposition(whole: float, piece: float, pieces: int) -> float:
    """Extra seconds of a matmul run as ``pieces`` row pieces of ``piece`` seconds instead of once (never
    negative: a piece is never more efficient than the whole)."""
    return max(0.0, pieces * piece - whole)


def _add(acc: list[float], exposed: float, contention: float = 0.0, extra: float = 0.0, passes: float = 0.0) -> None:
    """Accumulate one collective's (exposed, contention, extra, passes) seconds into ``acc``."""
    for j, v in enumerate((exposed, contention, extra, passes)):
        acc[j] += v


def layer_overlap(*, collectives: int, t: int, sequence_parallel: bool, nbytes: float,
                  coll: Callable[[str, float], float], cols: list[GemmChunks], rows: list[GemmChunks],
                  hw: Hardware, share: float, w_deferred: bool, elem_bytes: int,
                  grad_bytes: int) -> tuple[OverlapTime, OverlapTime]:
    """``(forward, backward)`` of one layer's ``collectives`` all-reduces of ``nbytes`` over ``t`` ranks,
    collective ``i`` paired with ``cols[i]`` and ``rows[i]`` where the layer has them (module doc).
    ``elem_bytes``: bytes of one activation / product element; ``grad_bytes``: of one weight-gradient element."""
    fwd, bwd = [0.0] * 4, [0.0] * 4
    # the weight gradient hides under nothing when a zero-bubble schedule runs it later
    w = 0.0 if w_deferred else 1.0
    waits = bool(hw.host_cores)  # CPU ranks: a hop's latency is waiting, which compute runs through (hop_exposed)
    for i in range(collectives):
        col = cols[i] if i < len(cols) else None
        row = rows[i] if i < len(rows) else None
        pair = _sp_pair if sequence_parallel else _plain_pair
        pair(fwd, bwd, col=col, row=row, t=t, nbytes=nbytes, coll=coll, hw=hw, share=share, w=w, waits=waits,
             grad_bytes=grad_bytes)
    if IN_PLACE_PIECES:
        fwd[3] = bwd[3] = 0.0
    return OverlapTime(*fwd), OverlapTime(*bwd)


def _sp_pair(fwd: list[float], bwd: list[float], *, col: GemmChunks | None, row: GemmChunks | None, t: int,
             nbytes: float, coll: Callable[[str, float], float], hw: Hardware, share: float, w: float, waits: bool,
             grad_bytes: int) -> None:
    """One sequence-parallel collective pair: the column layer's all-gather and the row layer's reduce-scatter in
    forward, their duals in backward, each a ring of t - 1 hops under its chunk matmuls."""
    partial = hw.memory_time(3 * nbytes / t, 1)  # a received partial sum added to this rank's: 2 reads, 1 write

    def zeroed(g: GemmChunks) -> float:
        """The weight gradient the pieces accumulate into, zeroed first."""
        return hw.memory_time(grad_bytes * g.weight_elems, 1)

    for op, gemm, forward in (("all_gather", col, True), ("reduce_scatter", row, True),
                              ("all_gather", row, False), ("reduce_scatter", col, False)):
        acc = fwd if forward else bwd
        # half of the all-reduce the unoverlapped term prices each sequence-parallel pair as (the link
        # model's all-gather + reduce-scatter exactly; a calibration's, the same convention)
        bw, lat = (x / 2 for x in split_collective(coll, "all_reduce", nbytes))
        if gemm is None:
            _add(acc, bw + lat)
            continue
        f, d, g = gemm.ring_piece(t)
        hide = f if forward else d + w * g
        exposed, contention = ring_exposed(bw, lat, t - 1, hide, share, _sm_share(hw, op), waits)
        if forward:
            extra = decomposition(gemm.fwd, f, t)
            # the gathered input concatenated (kept for backward); the scatter's partial sums
            passes = hw.memory_time(2 * gemm.in_bytes, 1) if op == "all_gather" else (t - 1) * partial
        else:
            extra = decomposition(gemm.dgrad, d, t) + decomposition(gemm.wgrad, g, t)
            # the scatter's partial sums; both accumulate the weight gradient from t pieces
            passes = (0.0 if op == "all_gather" else (t - 1) * partial) + zeroed(gemm)
        _add(acc, exposed, contention, extra, passes)


def _plain_pair(fwd: list[float], bwd: list[float], *, col: GemmChunks | None, row: GemmChunks | None, t: int,
                nbytes: float, coll: Callable[[str, float], float], hw: Hardware, share: float, w: float,
                waits: bool, grad_bytes: int) -> None:
    """One all-reduce pair without sequence parallelism: the row layer's forward all-reduce in pieces behind its
    matmul, the column layer's backward all-reduce under its weight-gradient matmul."""
    bw, lat = split_collective(coll, "all_reduce", nbytes)
    if row is None:
        _add(fwd, bw + lat)
    else:
        pieces = max(t, 2)
        f, _, _ = row.piece(pieces)
        exposed, contention, latencies = chunked_allreduce_exposed(bw, lat, pieces, f, share,
                                                                   _sm_share(hw, "all_reduce"), waits)
        _add(fwd, exposed, contention, decomposition(row.fwd, f, pieces) + latencies,
             hw.memory_time(2 * row.out_bytes, 1))  # the reduced pieces concatenated
    if col is None:
        _add(bwd, bw + lat)
    else:
        exposed, contention = ring_exposed(bw, lat, 1, w * col.wgrad, share, _sm_share(hw, "all_reduce"), waits)
        _add(bwd, exposed, contention)
