"""What ``shardwise bench comm`` reports: rows, bus-bandwidth factors, the table, the JSON file and the plot.

Pure formatting and arithmetic (no processes); the measuring lives in ``bench.py``.

Bandwidths follow nccl-tests (``doc/PERFORMANCE.md`` there): ``algbw = bytes / time`` and
``busbw = algbw · factor`` where the factor turns the algorithm bandwidth into the bandwidth each link must
sustain, so numbers are comparable across world sizes and against the hardware's peak:

* all-reduce: ``2(n-1)/n`` (a reduce-scatter then an all-gather, each moving ``(n-1)/n`` of the buffer);
* all-gather and reduce-scatter: ``(n-1)/n``;
* broadcast: 1 (every rank must receive the whole buffer once);
* all-to-all: ``(n-1)/n`` (all but this rank's own piece crosses a link; ``bytes`` is one rank's input).
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

__all__ = ["BenchRow", "BENCH_OPS", "ALL_OPS", "CHOICE_OPS", "bus_factor", "parse_size", "format_size",
           "power_of_two_sizes", "print_table", "write_json", "write_plot", "PLOT_INSTALL_HINT"]

BENCH_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter")
"""What ``shardwise bench comm`` measures by default."""
ALL_OPS: tuple[str, ...] = (*BENCH_OPS, "broadcast")
"""What ``shardwise calibrate`` measures: every collective of ``ALGORITHMS`` (native, ring, tree, shm)."""
CHOICE_OPS: tuple[str, ...] = (*ALL_OPS, "all_to_all")
"""What ``--ops`` accepts: those, and the uneven all-to-all (native against our pairwise one)."""
PLOT_INSTALL_HINT = "pip install 'shardwise[plot]' (or: pip install matplotlib)"
_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


@dataclass(frozen=True)
class BenchRow:
    """One measured (op, algorithm, size)."""

    op: str
    algorithm: str
    nbytes: int
    """Bytes of the full buffer: the all-reduced tensor, the all-gather output, the reduce-scatter input, one
    rank's all-to-all input (every rank sends as much, split unevenly)."""
    count: int
    """Elements of the full buffer."""
    dtype: str
    time_us: float
    """Mean time of one call, maximum over ranks."""
    algbw_GBps: float
    busbw_GBps: float
    max_error: float | None
    """Largest absolute deviation from the analytically known result (``None`` when not checked)."""


def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for ``op`` on ``n`` ranks (nccl-tests convention)."""
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if op == "all_reduce":
        return 2.0 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "broadcast":
        return 1.0
    raise ValueError(f"unknown collective {op!r}; choose one of {list(CHOICE_OPS)}")


def parse_size(text: str) -> int:
    """``"8"`` → 8, ``"64K"`` → 65536, ``"64M"``, ``"1G"`` (binary multiples; an optional trailing ``B``/``iB``)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"size {text!r} is not a byte count; write e.g. 8, 4K, 64M or 1G")
    value = int(m.group(1)) * _SUFFIX[m.group(2).upper()]
    if value < 1:
        raise ValueError(f"size {text!r} must be at least 1 byte")
    return value


def format_size(nbytes: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{suffix}"
    return str(nbytes)


def power_of_two_sizes(lo: int, hi: int) -> list[int]:
    """Every power of two ``p`` with ``lo <= p <= hi``; ``ValueError`` if there is none."""
    if lo > hi:
        raise ValueError(f"--min ({format_size(lo)}) is larger than --max ({format_size(hi)}); "
                         f"swap them, e.g. --min {format_size(hi)} --max {format_size(lo)}")
    sizes = [1 << k for k in range(hi.bit_length()) if lo <= 1 << k <= hi]
    if not sizes:
        raise ValueError(f"no power of two lies between --min {lo} and --max {hi}; widen the range")
    return sizes


_COLUMNS = ("bytes", "count", "type", "algorithm", "time (us)", "algbw (GB/s)", "busbw (GB/s)", "max error")


def _cells(row: BenchRow) -> list[str]:
    err = "-" if row.max_error is None else f"{row.max_error:.3g}"
    return [str(row.nbytes), str(row.count), row.dtype, row.algorithm, f"{row.time_us:.1f}",
            f"{row.algbw_GBps:.3f}", f"{row.busbw_GBps:.3f}", err]


def print_table(op: str, rows: Sequence[BenchRow], world_size: int, *, file: TextIO | None = None,
                plain: bool = False) -> None:
    """One table for ``op``, sorted by size then algorithm; rich when available (and not ``plain``)."""
    out = file or sys.stdout
    title = f"{op}  ({world_size} ranks, busbw = algbw x {bus_factor(op, world_size):.3g})"
    body = [_cells(r) for r in sorted(rows, key=lambda r: (r.nbytes, r.algorithm))]
    if not plain:
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            plain = True
    if plain:
        widths = [max(len(c), *(len(b[i]) for b in body)) if body else len(c) for i, c in enumerate(_COLUMNS)]
        print(f"# {title}", file=out)
        print("# " + "  ".join(c.rjust(w) for c, w in zip(_COLUMNS, widths)), file=out)
        for b in body:
            print("  " + "  ".join(c.rjust(w) for c, w in zip(b, widths)), file=out)
        out.flush()
        return
    table = Table(title=title, title_justify="left")
    for c in _COLUMNS:
        table.add_column(c, justify="left" if c in ("type", "algorithm") else "right")
    for b in body:
        table.add_row(*b)
    console = Console(file=out, width=None if out.isatty() else 120)
    console.print(table)


def write_json(path: str | Path, rows: Sequence[BenchRow], meta: Mapping[str, Any]) -> None:
    """Every measured row plus the run's settings (``meta``) as one JSON object."""
    Path(path).write_text(json.dumps({**meta, "results": [asdict(r) for r in rows]}, indent=2) + "\n")


def write_plot(path: str | Path, rows: Sequence[BenchRow], title: str) -> None:
    """busbw against size (log2 x), one panel per collective, one line per algorithm."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(f"--plot needs matplotlib, which is not installed; {PLOT_INSTALL_HINT}") from None
    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    ops = [op for op in CHOICE_OPS if any(r.op == op for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for algo in sorted({r.algorithm for r in rows if r.op == op}):
            pts = sorted((r.nbytes, r.busbw_GBps) for r in rows if r.op == op and r.algorithm == algo)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3, label=algo)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
