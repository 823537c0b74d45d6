"""The modules ``sw.parallelize`` puts in place of ``nn.Linear``/``nn.Embedding``: each holds this rank's shard
as an ordinary ``nn.Parameter`` under the original name (``weight``, ``bias``), so state_dict keys, optimizers
and hooks are unchanged. Every forward and backward is collective over the tp axis (see each class).

Shapes: ``b`` batch, ``t`` sequence, ``t_r`` this rank's sequence slice, ``i``/``o`` in/out features,
``o_r``/``i_r`` this rank's slice of them, ``v_r`` this rank's vocabulary slice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...comm import autograd as cag
from ...comm.ops import shard_offsets, shard_sizes
from ...mesh import Mesh
from ..common.materialize import deferred_piece, mark_drawn, read_full
from . import overlap
from ...sbp.params import annotate
from ...sbp.placement import Replicate, Split
from .rng import RNGStreams

__all__ = ["TPContext", "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "SEQ_DIM"]

SEQ_DIM = 1
"""The sequence dim of activations (b, t, h) in sequence-parallel mode."""


@dataclass
class TPContext:
    """What the parallel modules of one model share: mesh, axis, mode, RNG streams, and the sequence-piece
    sizes of the current forward (set where the sequence is first split, read by the all-gathers)."""

    mesh: Mesh
    axis: str
    sequence_parallel: bool
    rng: RNGStreams
    seq_sizes: list[int] | None = field(default=None)
    regions: list = field(default_factory=list)
    """The sequence-parallel gradient regions (``grad_regions.GradRegion``), in module order."""
    algorithm: str = "native"
    """Implementation of every tp collective (``comm``: native, ring, tree, shm or auto)."""
    last_input: tuple | None = field(default=None, repr=False)
    """(weakref to a column layer's input, (version, grad mode), its conversion): see ``gather_input``."""
    async_tp: bool = False
    """Overlap the column and row layers' collectives with their matmuls (``overlap.py``): see
    ``column_linear`` and ``row_linear``."""

    def sbp(self, dim: int | None) -> list:
        """One placement per mesh axis: ``Split(dim)`` on the tp axis (B when ``dim`` is None), B elsewhere."""
        return [Split(dim) if a == self.axis and dim is not None else Replicate() for a in self.mesh.axes]

    def split_sequence(self, t: int) -> tuple[int, int]:
        """Record the pieces of a length-``t`` sequence; return this rank's (start, length)."""
        n, c = self.mesh.size(self.axis), self.mesh.coord(self.axis)
        self.seq_sizes = shard_sizes(t, n)
        return shard_offsets(t, n)[c], self.seq_sizes[c]

    def gather_input(self, x: torch.Tensor) -> torch.Tensor:
        """Input of a column-parallel layer: B (identity; backward all-reduce) or S(seq) → B (all-gather;
        backward reduce-scatter).

        Column layers that read the same tensor one after the other (separate q, k, v projections of one
        normed input; a SwiGLU's gate and up) share one conversion: autograd then sums their input gradients
        locally and backward runs ONE all-reduce (or reduce-scatter) for the group, as for Megatron's fused
        qkv — not one per layer. The last conversion is kept for the next call only when it is the same
        tensor, unchanged since (``_version``), under the same grad mode; ``forget_input`` drops it at the
        model's forward boundaries."""
        cached = self._converted(x)
        if cached is not None:
            return cached
        if self.sequence_parallel:
            y = cag.allgather_reducescatter(x, self.mesh, self.axis, dim=SEQ_DIM, sizes=self.seq_sizes,
                                            algorithm=self.algorithm)
        else:
            y = cag.identity_allreduce(x, self.mesh, self.axis, algorithm=self.algorithm)
        self._remember(x, y)
        return y

    def _converted(self, x: torch.Tensor) -> torch.Tensor | None:
        """The conversion of ``x`` made by the previous column layer, if it read the same, unchanged tensor."""
        last = self.last_input
        if last is not None and last[0]() is x and last[1] == (x._version, torch.is_grad_enabled()):
            return last[2]
        return None

    def _remember(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.last_input = (weakref.ref(x), (x._version, torch.is_grad_enabled()), y)

    def overlapped(self) -> bool:
        """Whether the layers run ``overlap.py``'s decomposed collectives (async_tp on a tp axis of size > 1)."""
        return self.async_tp and self.mesh.size(self.axis) > 1

    def column_linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """A column layer: ``F.linear(gather_input(x), w, b)``. With ``async_tp`` the first layer reading ``x``
        runs the conversion fused with its matmul (SP: ring all-gather overlapped with the chunk matmuls; else
        the backward all-reduce under the weight-gradient matmul) and its converted input is what the next
        layers reading ``x`` reuse, so their input gradients join its one reduce-scatter (all-reduce).
        x (b, t_r, i) with SP, (b, t, i) without; w (o_r, i) → (b, t, o_r)."""
        cached = self._converted(x)
        if cached is not None or not self.overlapped():
            return F.linear(cached if cached is not None else self.gather_input(x), w, b)
        if self.sequence_parallel and x.dim() != 3:  # the rings cut (b, t, h) activations only
            return F.linear(self.gather_input(x), w, b)
        if self.sequence_parallel:
            n = self.mesh.size(self.axis)
            sizes = self.seq_sizes if self.seq_sizes is not None else [x.size(SEQ_DIM)] * n
            y, conv = overlap.gather_linear(x, w, b, self.mesh, self.axis, sizes=sizes, algorithm=self.algorithm)
        else:
            y, conv = overlap.allreduce_grad_linear(x, w, b, self.mesh, self.axis, algorithm=self.algorithm)
        self._remember(x, conv)
        return y

    def row_linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A row layer's reduced product (bias not added): ``reduce_output(F.linear(x, w))``. With ``async_tp``
        (``overlap.py``): SP, the reduce-scatter as a ring of partial sums, one chunk matmul per hop; else the
        all-reduce in pieces, each under the next piece's matmul. x (b, t, i_r), w (o, i_r) → (b, t_r, o) with
        SP, (b, t, o) without."""
        if not self.overlapped() or (self.sequence_parallel and x.dim() != 3):
            return self.reduce_output(F.linear(x, w))
        if self.sequence_parallel:
            return overlap.linear_scatter(x, w, self.mesh, self.axis, algorithm=self.algorithm)
        return overlap.linear_allreduce(x, w, self.mesh, self.axis, algorithm=self.algorithm)

    def forget_input(self) -> None:
        self.last_input = None

    def reduce_output(self, y: torch.Tensor) -> torch.Tensor:
        """Partial output: P → B (all-reduce; backward identity) or P → S(seq) (reduce-scatter; backward
        all-gather)."""
        if self.sequence_parallel:
            return cag.reducescatter_allgather(y, self.mesh, self.axis, dim=SEQ_DIM, algorithm=self.algorithm)
        return cag.allreduce_identity(y, self.mesh, self.axis, algorithm=self.algorithm)


def shard_param(full: torch.Tensor, ctx: TPContext, dim: int | None) -> nn.Parameter:
    """This rank's piece of ``full`` along ``dim`` (whole when None), annotated with its global description. A meta
    ``full`` (built on the meta device) gives a meta piece whose source reads only that piece, when the last
    wrapper materialises it (``materialize.SliceSource``: ZeRO-3 then reads flat ranges of the piece, a pipeline
    only its own stages' pieces)."""
    n, c = ctx.mesh.size(ctx.axis), ctx.mesh.coord(ctx.axis)
    if full.is_meta and dim in (None, 0, 1) and full.dim() >= 1:
        span = (shard_offsets(full.size(dim), n)[c], shard_sizes(full.size(dim), n)[c]) if dim is not None else None
        rows = [span] if dim == 0 else [(0, full.size(0))]
        cols = (span[0], span[0] + span[1]) if dim == 1 and span is not None else None
        p = deferred_piece(full, rows, cols)  # type: ignore[list-item]
    else:
        if full.is_meta:  # a scalar or a split past dim 1: read the whole tensor, keep the piece
            full_value = read_full(full, ctx.mesh.device)
        else:
            full_value = full.detach()
        local = full_value if dim is None else full_value.split(shard_sizes(full.size(dim), n), dim=dim)[c]
        p = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
        if full.is_meta:
            mark_drawn(p)
    annotate(p, ctx.mesh, ctx.sbp(dim), shape=tuple(full.shape))
    return p


def shard_heads(full: torch.Tensor, ctx: TPContext, fused: int, n_head: int, dim: int = 0) -> nn.Parameter:
    """Whole heads of a fused projection: ``full`` (fused·nh·hd, ...) viewed as (fused, nh, hd, ...); this rank
    keeps heads [c·nh/tp, (c+1)·nh/tp) of every chunk → (fused·nh/tp·hd, ...). ``dim=1``: the transposed layout
    (i, fused·nh·hd), the same heads' columns → (i, fused·nh/tp·hd). Not a contiguous block of ``full``, so it
    carries ``_shardwise_heads`` = (mesh, axis, fused, full shape, view, dim) instead of an SBP annotation: ``view`` is
    a reshape of ``full`` in which this rank's piece is a plain split on dim 1 — (fused, nh·hd, ...), or
    (i·fused, nh·hd) when transposed. A meta ``full`` gives a meta piece that reads only those rows (transposed:
    columns) when materialised."""
    n, c = ctx.mesh.size(ctx.axis), ctx.mesh.coord(ctx.axis)
    per = n_head // n
    rest = tuple(full.shape[1:])
    if dim == 1:
        i, width = full.size(0), full.size(1) // fused  # (i, fused·nh·hd): each chunk `width` = nh·hd columns
        hd = width // n_head
        if full.is_meta:  # reads only this rank's columns of each chunk when materialised
            spans = [(f * width + c * per * hd, f * width + (c + 1) * per * hd) for f in range(fused)]
            p = deferred_piece(full, [(0, i)], spans)
        else:  # (i, fused, nh, hd) -> keep this rank's heads of every chunk
            cols = full.detach().reshape(i, fused, n_head, -1)[:, :, c * per:(c + 1) * per].reshape(i, -1)
            p = nn.Parameter(cols.clone(), requires_grad=full.requires_grad)
        view: tuple[int, ...] = (i * fused, width)
    elif full.is_meta:
        rows = full.size(0) // (fused * n_head)  # hd
        p = deferred_piece(full, [(f * n_head * rows + c * per * rows, per * rows) for f in range(fused)], None)
        view = (fused, full.size(0) // fused, *rest)
    else:
        local = full.detach().reshape(fused, n_head, -1, *rest)[:, c * per:(c + 1) * per].reshape(-1, *rest)
        p = nn.Parameter(local.clone(), requires_grad=full.requires_grad)
        view = (fused, full.size(0) // fused, *rest)
    p._shardwise_heads = (ctx.mesh, ctx.axis, fused, tuple(full.shape), view, dim)  # type: ignore[attr-defined]
    return p


def heads_local_shape(heads: tuple) -> tuple[int, ...]:
    """This rank's shape of a head-split parameter (its ``_shardwise_heads``): the full shape with the split dim
    (0, or 1 when transposed) divided by the tp size. Pure."""
    mesh, axis, _fused, full_shape, _view, dim = heads
    shape = list(full_shape)
    shape[dim] //= mesh.size(axis)
    return tuple(shape)


class ColumnParallelLinear(nn.Module):
    """y_r = x · W_rᵀ + b_r with W (o, i) split S(0): output (b, t, o_r), S(-1). ``transposed``: W stored
    (i, o) (``Conv1D``), split S(1), y_r = x · W_r + b_r. Input B, or S(seq) gathered first in
    sequence-parallel mode. Collective: backward all-reduce (or forward all-gather + backward reduce-scatter with
    SP). Ends the shared-RNG region (its output is split)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, ctx: TPContext, out_features: int,
                 transposed: bool = False) -> None:
        super().__init__()
        self.weight, self.bias, self.ctx, self.transposed = weight, bias, ctx, transposed
        self.in_features, self.out_features = weight.size(0 if transposed else 1), out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        w = self.weight.t() if self.transposed else self.weight  # (o_r, i)
        y = ctx.column_linear(x, w, self.bias)  # (b, t, i) @ (i, o_r) -> (b, t, o_r)
        if not ctx.sequence_parallel:  # with SP the whole forward is one split region (entered at the root)
            ctx.rng.enter_split()
        return y

    def extra_repr(self) -> str:
        local = self.weight.size(1 if self.transposed else 0)
        return f"in={self.in_features}, out={self.out_features} (local {local}), axis={self.ctx.axis}"


class VocabParallelHead(ColumnParallelLinear):
    """An LM head column-parallel over the vocabulary; its logits (b, t, v_r) carry their global shape (so
    ``vocab_parallel_cross_entropy`` finds V)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        annotate(y, self.ctx.mesh, self.ctx.sbp(y.dim() - 1), shape=(*y.shape[:-1], self.out_features))
        return y


class RowParallelLinear(nn.Module):
    """y = Σ_r x_r · W_rᵀ + b with W (o, i) split S(1): input (b, t, i_r), S(-1); the partial product is
    all-reduced (SP: reduce-scattered on the sequence) and the replicated bias added after. Collective:
    forward all-reduce (SP: forward reduce-scatter + backward all-gather). Starts a shared-RNG region.
    ``transposed``: W stored (i, o) (``Conv1D``), split S(0)."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, ctx: TPContext, in_features: int,
                 transposed: bool = False) -> None:
        super().__init__()
        self.weight, self.bias, self.ctx, self.transposed = weight, bias, ctx, transposed
        self.in_features, self.out_features = in_features, weight.size(1 if transposed else 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if not ctx.sequence_parallel:
            ctx.rng.leave_split()
        w = self.weight.t() if self.transposed else self.weight  # (o, i_r)
        y = ctx.row_linear(x, w)  # (b, t, i_r) @ (i_r, o) -> partial (b, t, o), reduced
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        local = self.weight.size(0 if self.transposed else 1)
        return f"in={self.in_features} (local {local}), out={self.out_features}, axis={self.ctx.axis}"


class VocabParallelEmbedding(nn.Module):
    """Lookup in a table split S(0) on the vocabulary: ids outside this rank's rows give zeros, the partial
    (b, t, h) is all-reduced (SP: reduce-scattered to (b, t_r, h)). Collective: forward all-reduce (SP:
    forward reduce-scatter + backward all-gather)."""

    def __init__(self, weight: nn.Parameter, ctx: TPContext, num_embeddings: int, padding_idx: int | None) -> None:
        super().__init__()
        self.weight, self.ctx, self.num_embeddings = weight, ctx, num_embeddings
        n, c = ctx.mesh.size(ctx.axis), ctx.mesh.coord(ctx.axis)
        self.start = shard_offsets(num_embeddings, n)[c]
        self.stop = self.start + weight.size(0)
        local_pad = None if padding_idx is None else padding_idx - self.start
        self.padding_idx = local_pad if local_pad is not None and 0 <= local_pad < weight.size(0) else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        outside = (idx < self.start) | (idx >= self.stop)
        local = (idx - self.start).masked_fill(outside, 0)
        if self.weight.size(0) == 0:
            out = self.weight.new_zeros((*idx.shape, self.weight.size(1)))
        else:
            out = F.embedding(local, self.weight, self.padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if ctx.sequence_parallel and idx.dim() >= 2:
            ctx.split_sequence(idx.size(SEQ_DIM))
        return ctx.reduce_output(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (local [{self.start}, {self.stop})), {self.weight.size(1)}, axis={self.ctx.axis}"
