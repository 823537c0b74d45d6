"""How sure a prediction is: the error band of its hardware class and layout family, and the ties it implies.

A prediction's band is the spread of the planner's errors on the published and measured rows of the same
*hardware class* (``hardware_class``: the A100 preset, the H100/H200 presets, a GPU calibration, a GPU quick
probe, CPU ranks) and *layout family* (``layout_family``: data parallel / ZeRO, tensor parallel, pipeline,
context parallel, experts): the median |error| (``typical``) and the largest (``worst``) of those rows, from
``BANDS``. A family without rows on its class falls back to the class's rows of any layout; a class without any
rows has no band (``error_band`` returns None).

Two layouts whose predicted step times differ by less than the faster one's typical error are a *tie*
(``tied``): the model cannot tell them apart, and ``recommend`` prefers the one with less machinery
(``search.simplicity``). Without a band the tie is the search's own resolution, ``search.TIE``. Pure: no
processes, no files.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .hardware import PRESETS, Hardware
from .plan import Layout
from .predict import Prediction
from .search import TIE, simplicity

__all__ = ["ErrorBand", "BANDS", "BANDS_HELD_OUT", "ANY_LAYOUT", "HARDWARE_CLASSES", "FAMILIES", "hardware_class",
           "layout_family", "error_band", "tie_tolerance", "tied", "ties", "ranked", "recommend"]

HARDWARE_CLASSES = ("A100", "H100/H200", "calibrated GPU", "probed GPU", "calibrated CPU")
"""What ``hardware_class`` returns: the presets by chip, then the user's own machine by how it was measured."""

FAMILIES = ("context parallel", "experts", "pipeline", "tensor parallel", "data parallel / ZeRO")
"""What ``layout_family`` returns, in its order of precedence (the first that applies names the layout)."""

ANY_LAYOUT = "any layout"
"""The family key of a hardware class's fallback band (every row of the class)."""

# The held-out errors of the one check's graded step-time and throughput rows (benchmarks/planner/check_report.py
# ``bands``), written by ``python benchmarks/planner_published.py --write-bands``; tests/unit/test_planner_tables.py
# fails when they differ from what the check computes. (typical = median |error|, worst = max |error|, rows, tables)
BANDS: dict[tuple[str, str], tuple[float, float, int, str]] = {
    ("A100", ANY_LAYOUT): (0.076, 0.132, 26, "megatron-table1, korthikanti-table5, narayanan-table2-ptdp"),
    ("A100", "data parallel / ZeRO"): (0.024, 0.024, 1, "megatron-table1"),
    ("A100", "pipeline"): (0.078, 0.132, 20, "megatron-table1, korthikanti-table5, narayanan-table2-ptdp"),
    ("A100", "tensor parallel"): (0.056, 0.068, 5, "megatron-table1, korthikanti-table5"),
    ("H100/H200", ANY_LAYOUT): (0.099, 0.584, 14, "llama3-table4, mcore-weak-scaling, moe-bridge-bf16"),
    ("H100/H200", "context parallel"): (0.224, 0.224, 1, "llama3-table4"),
    ("H100/H200", "data parallel / ZeRO"): (0.356, 0.356, 1, "mcore-weak-scaling"),
    ("H100/H200", "experts"): (0.516, 0.584, 2, "moe-bridge-bf16"),
    ("H100/H200", "pipeline"): (0.084, 0.11, 7, "llama3-table4, mcore-weak-scaling"),
    ("H100/H200", "tensor parallel"): (0.169, 0.192, 3, "mcore-weak-scaling"),
    ("calibrated CPU", ANY_LAYOUT): (0.054, 0.141, 15, "cpu-calibrated"),
    ("calibrated CPU", "data parallel / ZeRO"): (0.073, 0.141, 6, "cpu-calibrated"),
    ("calibrated CPU", "pipeline"): (0.093, 0.114, 6, "cpu-calibrated"),
    ("calibrated CPU", "tensor parallel"): (0.016, 0.029, 3, "cpu-calibrated"),
    ("calibrated GPU", ANY_LAYOUT): (0.018, 0.158, 6, "h200-calibrated"),
    ("calibrated GPU", "data parallel / ZeRO"): (0.018, 0.158, 6, "h200-calibrated"),
    ("probed GPU", ANY_LAYOUT): (0.124, 0.278, 18, "h200-quick-probe"),
    ("probed GPU", "data parallel / ZeRO"): (0.124, 0.278, 18, "h200-quick-probe"),
}

BANDS_HELD_OUT = True
"""Whether ``BANDS`` holds held-out errors (each row predicted with constants fitted without its table) or, while
False, in-sample ones; ``ErrorBand.describe`` says which."""

_PUBLISHED = {"A100", "H100/H200"}
_NOUNS = {"pipeline": "pipelines", "tensor parallel": "tensor-parallel layouts",
          "data parallel / ZeRO": "data-parallel / ZeRO layouts", "context parallel": "context-parallel layouts",
          "experts": "expert-parallel layouts", ANY_LAYOUT: "layouts of any family"}


def hardware_class(hw: Hardware) -> str:
    """Which rows ``hw``'s predictions are judged by (``HARDWARE_CLASSES``). CPU ranks (``kind == "cpu"``, a
    calibration or the quick probe): ``calibrated CPU``. A GPU calibration (``Hardware.load``: measured fp32 GEMM
    points or a timed block): ``calibrated GPU``. The GPU quick probe (bf16 points only): ``probed GPU``. Else a
    spec-sheet description: ``A100`` when its dense bf16 peak is the A100 preset's, ``H100/H200`` otherwise (the
    H100 and H200 presets and any other uncalibrated GPU, priced like them)."""
    if hw.kind == "cpu":
        return "calibrated CPU"
    if hw.gemm_points or hw.block_probe:
        return "calibrated GPU"
    if hw.gemm_points_bf16:
        return "probed GPU"
    a100 = PRESETS["a100-80g-sxm"]
    return "A100" if hw.peak_flops.get("bf16") == a100.peak_flops["bf16"] else "H100/H200"


def layout_family(plan: Layout) -> str:
    """The family a layout is judged with (``FAMILIES``), the first that applies: ``context parallel`` (cp > 1),
    ``experts`` (ep > 1; a mixture of experts at ep 1 cannot be told from the layout alone), ``pipeline`` (pp > 1,
    any tp), ``tensor parallel`` (tp > 1), else ``data parallel / ZeRO``."""
    if plan.cp > 1:
        return "context parallel"
    if plan.ep > 1:
        return "experts"
    if plan.pp > 1:
        return "pipeline"
    return "tensor parallel" if plan.tp > 1 else "data parallel / ZeRO"


@dataclass(frozen=True)
class ErrorBand:
    """The planner's error on the rows like one prediction: ``typical`` (median |relative error|) and ``worst``
    (max) over ``rows`` rows of ``tables``, for ``hardware`` (a class) and ``family`` (``ANY_LAYOUT``: the
    class's fallback, no rows of the prediction's own family)."""

    typical: float
    worst: float
    rows: int
    hardware: str
    family: str
    tables: str
    held_out: bool = False

    def describe(self, seconds: float) -> str:
        """``"1.43 s, typically within ±5.5 % (worst ±11 %, 20 held-out rows of published A100 pipelines:
        megatron-table1, …)"``."""
        kind = ("held-out" if self.held_out else "in-sample") + f" row{'s' * (self.rows != 1)}"
        source = "published" if self.hardware in _PUBLISHED else "measured"
        return (f"{seconds:.3g} s, typically within ±{_pct(self.typical)} (worst ±{_pct(self.worst)}, {self.rows} "
                f"{kind} of {source} {self.hardware} {_NOUNS[self.family]}: {self.tables})")

    def short(self) -> str:
        """``"±5.5 %"``: the typical error alone (a table cell)."""
        return f"±{_pct(self.typical)}"

    def to_json(self) -> dict[str, Any]:
        return {"typical": self.typical, "worst": self.worst, "rows": self.rows, "hardware": self.hardware,
                "family": self.family, "tables": self.tables, "held_out": self.held_out}


def _pct(x: float) -> str:
    """A relative error as a percentage: one decimal below 10 %, none above."""
    return f"{x * 100:.1f} %" if x < 0.0995 else f"{x * 100:.0f} %"


MIN_ROWS = 3
"""Rows a family's band needs to be quoted: fewer (one or two published rows) say little about a distribution, so
the class's rows of any layout are quoted instead."""


def error_band(hw: Hardware, plan: Layout) -> ErrorBand | None:
    """The band of ``plan`` on ``hw`` from ``BANDS``: its class and family where that rests on ``MIN_ROWS`` rows or
    more, else its class's ``ANY_LAYOUT`` band, else None (nothing is known about the class)."""
    cls, family = hardware_class(hw), layout_family(plan)
    for key in ((cls, family), (cls, ANY_LAYOUT)):
        if key in BANDS and (BANDS[key][2] >= MIN_ROWS or key[1] == ANY_LAYOUT):
            typical, worst, rows, tables = BANDS[key]
            return ErrorBand(typical, worst, rows, cls, key[1], tables, BANDS_HELD_OUT)
    return None


def tie_tolerance(hw: Hardware, fastest: Layout) -> float:
    """The relative gap under which a layout ties with ``fastest``: the typical error of ``fastest``'s band
    (its class and family), else the search's own resolution ``search.TIE``."""
    band = error_band(hw, fastest)
    return max(band.typical, TIE) if band is not None else TIE


def tied(a: Prediction, b: Prediction, hw: Hardware) -> bool:
    """Whether the model cannot tell ``a`` and ``b`` apart: the slower's step time exceeds the faster's by less
    than the faster's ``tie_tolerance``."""
    fast, slow = sorted((a, b), key=lambda p: p.step_time_s)
    return slow.step_time_s - fast.step_time_s < tie_tolerance(hw, fast.plan) * fast.step_time_s


def ties(predictions: Sequence[Prediction], hw: Hardware) -> list[list[Prediction]]:
    """``predictions`` cut into groups the model cannot tell apart, fastest group first: the fastest prediction
    left and every other left that ``tied`` with it, each group fastest first. Every prediction is in one group
    (a group of one: no tie)."""
    left = sorted(predictions, key=lambda p: p.step_time_s)
    groups = []
    while left:
        head = left[0]
        group = [p for p in left if p is head or tied(head, p, hw)]
        groups.append(group)
        left = [p for p in left if all(p is not q for q in group)]
    return groups


def ranked(predictions: Sequence[Prediction], hw: Hardware) -> list[int]:
    """Indices of ``predictions`` in the order they are recommended: the fastest and the layouts tied with it,
    simplest first (``search.simplicity``, then step time), then the rest in their given order (the search's)."""
    if not predictions:
        return []
    first = ties(predictions, hw)[0]
    order = sorted(first, key=lambda p: (simplicity(p.plan), p.step_time_s))
    head = [next(i for i, q in enumerate(predictions) if q is p) for p in order]
    return head + [i for i in range(len(predictions)) if i not in head]


def recommend(predictions: Sequence[Prediction], hw: Hardware) -> Prediction:
    """The layout to run: the simplest of the fastest prediction and those tied with it (``ranked``'s first).
    ``shardwise plan`` prints it and ``shardwise train --parallel.auto`` runs it."""
    if not predictions:
        raise ValueError("recommend needs at least one prediction; got none (search found no plan)")
    return predictions[ranked(predictions, hw)[0]]
