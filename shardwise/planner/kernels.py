"""Published throughput of fused attention kernels, as plain data, and its lookup.

Each row is one published figure: a kernel's TF/s on one device at head dimension ``head_dim``, causal mask or not,
forward or backward, at the sequence lengths ``SEQS`` (the FlashAttention papers' sweep: batch × sequence = 16K
tokens, hidden 2048, BF16). Their FLOP convention, which ``compute._fused_core`` keeps: forward
``4 · seq² · head_dim · heads`` (the two products), halved with a causal mask; backward 2.5× the forward
(five tile products to two). So ``time = FLOPs / (TF/s)`` in either direction, and a row's efficiency is its TF/s
over the device's dense BF16 peak.

``attention_efficiency`` picks a table by ``Hardware.attention_table`` (``""``: none, the caller keeps its
per-head-GEMM proxy), the row of the nearest head dimension with the wanted mask and direction, and interpolates
in ``log seq``, clamped to the sweep's ends. Where a figure was not published (causal backward on the H100) a
row is derived from published ones and its source says how.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

__all__ = ["SEQS", "AttentionRow", "AttentionTable", "ATTENTION_TABLES", "attention_efficiency", "table_efficiency",
           "attention_row"]

SEQS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
"""Sequence lengths of every row's ``tflops`` (the papers' x axis)."""

_DIRECTIONS = ("fwd", "bwd")


class _Device(Protocol):
    """What the lookup reads of a ``Hardware`` (hardware.py imports this module, so not the class itself)."""

    name: str
    attention_table: str
    sustained_fraction: float


@dataclass(frozen=True)
class AttentionRow:
    """One published (or derived) throughput curve: TF/s at each of ``SEQS``."""

    head_dim: int
    causal: bool
    direction: str
    tflops: tuple[float, ...]
    source: str


@dataclass(frozen=True)
class AttentionTable:
    """A kernel's rows on one device; ``peak_tflops`` is the dense BF16 peak the efficiencies are taken of."""

    name: str
    kernel: str
    device: str
    peak_tflops: float
    rows: tuple[AttentionRow, ...]


_FA3 = "Shah et al. 2024, FlashAttention-3 (arXiv 2407.08608)"
_H100 = "H100 80GB SXM5, BF16, batch x seq = 16K, hidden 2048"


def _fig(direction: str, head_dim: int, causal: bool, bars: str) -> str:
    fig = "Fig. 5 (forward speed)" if direction == "fwd" else "Fig. 6 (backward speed)"
    mask = "causal" if causal else "no causal mask"
    return f"{_FA3} {fig}, head dim {head_dim}, {mask}, {_H100}: the {bars} bars' labels"


def _rows(bars: str, fwd: dict[tuple[int, bool], tuple[float, ...]],
          bwd: dict[int, tuple[float, ...]]) -> tuple[AttentionRow, ...]:
    """Forward rows as published; backward rows published without a mask; causal backward derived: the
    non-causal backward × the forward's causal / non-causal ratio at the same head dim and sequence (the mask
    skips the same tiles both ways; FlashAttention-3 publishes no causal backward)."""
    rows = [AttentionRow(hd, causal, "fwd", tf, _fig("fwd", hd, causal, bars)) for (hd, causal), tf in fwd.items()]
    for hd, tf in bwd.items():
        rows.append(AttentionRow(hd, False, "bwd", tf, _fig("bwd", hd, False, bars)))
        ratio = [c / n for c, n in zip(fwd[(hd, True)], fwd[(hd, False)])]
        rows.append(AttentionRow(hd, True, "bwd", tuple(round(b * r, 1) for b, r in zip(tf, ratio)),
                                 f"derived: {_fig('bwd', hd, False, bars)} x the forward's causal / no-mask ratio "
                                 f"({_fig('fwd', hd, True, bars)})"))
    return tuple(rows)


# TF/s at SEQS, read from the value labels of FlashAttention-3's bar charts (H100 SXM5, BF16). cuDNN: the
# "cuDNN" bars (cuDNN 9's fused flash attention, what Transformer Engine's FusedAttention backend runs on Hopper);
# FlashAttention-2 and -3: their own bars. Backward: head dims 64 and 128 only (Fig. 6); 256 uses 128's.
_CUDNN_H100 = _rows("cuDNN", {
    (64, False): (335, 373, 395, 408, 412, 413), (64, True): (225, 288, 334, 363, 379, 388),
    (128, False): (497, 574, 617, 609, 600, 595), (128, True): (315, 410, 484, 518, 529, 539),
    (256, False): (470, 546, 580, 581, 580, 581), (256, True): (308, 391, 450, 483, 497, 509),
}, {64: (266, 348, 395, 417, 432, 433), 128: (305, 408, 465, 499, 518, 516)})

_FA3_H100 = _rows("FlashAttention-3", {
    (64, False): (333, 392, 460, 476, 496, 497), (64, True): (197, 265, 371, 420, 460, 473),
    (128, False): (467, 565, 625, 638, 646, 648), (128, True): (292, 423, 521, 579, 602, 616),
    (256, False): (482, 639, 707, 736, 746, 756), (256, True): (286, 427, 537, 612, 628, 642),
}, {64: (272, 363, 422, 453, 472, 474), 128: (316, 424, 501, 542, 559, 561)})

_FA2_H100 = _rows("FlashAttention-2", {
    (64, False): (282, 306, 318, 321, 322, 324), (64, True): (180, 229, 262, 284, 295, 299),
    (128, False): (309, 350, 362, 368, 370, 370), (128, True): (191, 260, 298, 319, 333, 335),
    (256, False): (275, 313, 321, 323, 324, 326), (256, True): (208, 251, 278, 293, 297, 298),
}, {64: (198, 238, 264, 279, 287, 291), 128: (214, 260, 291, 310, 318, 322)})

ATTENTION_TABLES: dict[str, AttentionTable] = {
    "h100-cudnn": AttentionTable("h100-cudnn", "cuDNN fused attention", "H100 SXM5", 989.0, _CUDNN_H100),
    "h100-fa3": AttentionTable("h100-fa3", "FlashAttention-3", "H100 SXM5", 989.0, _FA3_H100),
    "h100-fa2": AttentionTable("h100-fa2", "FlashAttention-2", "H100 SXM5", 989.0, _FA2_H100),
}
"""Every table by name (``Hardware.attention_table``). 989 TF/s: the H100 SXM datasheet's dense BF16 peak."""


def attention_row(table: str, head_dim: float, causal: bool, direction: str) -> AttentionRow:
    """The row of ``table`` with ``causal`` and ``direction`` at the head dimension nearest ``head_dim`` (in log;
    a tie goes to the larger)."""
    if table not in ATTENTION_TABLES:
        raise ValueError(f"unknown attention table {table!r}; choose one of {sorted(ATTENTION_TABLES)} or \"\" "
                         f"(the per-head-GEMM proxy)")
    if direction not in _DIRECTIONS:
        raise ValueError(f"attention direction must be one of {_DIRECTIONS}, got {direction!r}")
    if not head_dim > 0:
        raise ValueError(f"attention head_dim must be > 0, got {head_dim!r}")
    rows = [r for r in ATTENTION_TABLES[table].rows if r.causal == causal and r.direction == direction]
    return min(rows, key=lambda r: (abs(math.log(r.head_dim / head_dim)), -r.head_dim))


def attention_efficiency(hw: _Device, head_dim: float, seq: float, causal: bool, direction: str) -> float:
    """Fraction of ``hw``'s dense BF16 peak its attention kernel sustains (``table_efficiency`` of
    ``hw.attention_table`` × ``hw.sustained_fraction``, as ``Hardware.gemm_efficiency`` scales its curve);
    ``ValueError`` if ``hw`` names no table (``""``: the caller's per-head-GEMM proxy)."""
    if not hw.attention_table:
        raise ValueError(f"hardware {hw.name!r} has no attention table (attention_table = \"\"): price the "
                         f"attention core with its per-head GEMM efficiency, or set one of {sorted(ATTENTION_TABLES)}")
    return hw.sustained_fraction * table_efficiency(hw.attention_table, head_dim, seq, causal, direction)


def table_efficiency(table: str, head_dim: float, seq: float, causal: bool, direction: str) -> float:
    """Fraction of the dense BF16 peak that ``table``'s kernel reaches at this head dimension (nearest row),
    sequence length (interpolated in log, clamped to ``SEQS``), mask and direction (module doc's FLOPs)."""
    row = attention_row(table, head_dim, causal, direction)
    peak = ATTENTION_TABLES[table].peak_tflops
    x = min(max(float(seq), SEQS[0]), SEQS[-1])
    for (s0, t0), (s1, t1) in zip(zip(SEQS, row.tflops), zip(SEQS[1:], row.tflops[1:])):
        if x <= s1:
            w = math.log(x / s0) / math.log(s1 / s0)
            return (t0 + w * (t1 - t0)) / peak
    return row.tflops[-1] / peak
