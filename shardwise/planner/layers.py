"""The rows of a ``ModelSpec``: one ``Layer`` per cuttable unit, its ``Gemm``s per sequence (see ``spec.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Gemm", "Layer", "Split"]

Split = Literal["col", "row", "heads", "none"]


@dataclass(frozen=True)
class Gemm:
    """``batch`` matrix products ``(rows × k) @ (k × n)`` per sequence."""

    name: str
    rows: int
    k: int
    n: int
    split: Split = "none"
    """How tensor parallelism divides it: ``col`` splits n, ``row`` splits k, ``heads`` splits batch."""
    batch: int = 1
    weight: bool = True
    """A weight GEMM (backward = input gradient + weight gradient); attention cores have no weight."""
    causal: bool = False
    """A causal attention core: a fused kernel skips the masked half."""
    experts: int = 0
    """A grouped GEMM over ``experts`` routed experts (mixture of experts): ``rows`` are every routed token row of
    the sequence (tokens × top_k), ``rows / experts`` per expert on average; expert parallelism gives a rank
    ``experts / ep`` of them with ``ep`` times the rows each (``compute._shape``). 0: an ordinary GEMM."""

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.k * self.n * self.batch


@dataclass(frozen=True)
class Layer:
    """One cuttable unit (embedding, a block, the head), per sequence."""

    name: str
    kind: str
    """``embedding``, ``block``, ``head`` or ``other``."""
    params: int
    tp_params: int = 0
    """Parameters tensor parallelism splits (the rest are replicated over tp)."""
    gemms: tuple[Gemm, ...] = ()
    ew_rep: float = 0.0
    """Elements read + written by memory-bound kernels in forward, not split by tp (split by sequence
    parallelism)."""
    ew_tp: float = 0.0
    """... split by tp."""
    ops: int = 0
    """Non-GEMM kernel launches in forward."""
    act_rep: float = 0.0
    """Activation elements kept for backward, replicated over tp (split by sequence parallelism)."""
    act_tp: float = 0.0
    """Activation elements kept for backward, split by tp."""
    act_attn: float = 0.0
    """Attention-core elements (softmax/dropout, ``O(s²)``), split by tp; selective recomputation drops them (with
    every other activation but the weight GEMMs' outputs)."""
    act_fp32: float = 0.0
    """Elements kept in fp32 whatever the precision (e.g. log-softmax of the loss), split by tp."""
    hidden: int = 0
    """Elements of the layer's output per sequence (``s·h``): pipeline p2p and tensor-parallel all-reduces."""
    tp_allreduces: int = 0
    """All-reduces of ``hidden`` elements per forward under tensor parallelism (backward has as many)."""
    tied: str = ""
    """Name of the layer whose weight this one shares (the tied head)."""
    shared: int = 0
    """Parameters of ``params`` that are the tied layer's (counted once when both sit on one device)."""
    replicated: bool = False
    """Kept whole on every tensor-parallel rank (a module pinned data-parallel): no tp split, no tp comm."""
    largest: int = 0
    """Elements of the layer's largest parameter tensor (built whole before a rank keeps its slice: the
    construction peak); 0 = unknown, then its largest weight GEMM, else all of ``params``."""
    expert_params: int = 0
    """Parameters of ``params`` (and of ``tp_params``) that are routed experts': expert parallelism divides them
    by ``ep``, and their gradients are averaged over the ``dp·cp/ep`` ranks that hold the same experts."""
    inactive: int = 0
    """Parameters a token does not use (the routed experts it is not sent to: ``(E - top_k)/E`` of them);
    ``ModelSpec.active_params`` leaves them out."""
    a2a: float = 0.0
    """Elements one expert-parallel all-to-all dispatches per sequence (tokens × top_k × hidden); four per
    layer and step (dispatch and combine, forward and backward; ``moe.a2a_bytes``)."""
    imbalance: float = 1.0
    """The most loaded expert-parallel rank's routed tokens over the mean (1.0: an ideal balance). Scales the
    expert GEMMs and the all-to-alls of ``ep > 1`` (that rank sets the pace of every rank)."""
    frozen: int = 0
    """Parameters of ``params`` that train nothing (a LoRA base, a frozen embedding): parameter bytes only, no
    gradient or optimizer state. The trainable rest (``params - frozen``) is counted whole on every tp rank (adapters
    are small); ``ModelSpec.with_adapters`` sets it."""

    @property
    def flops(self) -> float:
        """Forward FLOPs per sequence (GEMMs)."""
        return sum(g.flops for g in self.gemms)
