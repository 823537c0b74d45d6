"""Tensor-parallel styles (plain data) and the pure half of ``sw.parallelize``: matching a plan against module
names and validating every (module, style) pair before anything is sharded or sent.

A plan maps ``fnmatch`` patterns over ``named_modules()`` names to styles. Each style is the SBP signature of
one layer on the tp axis (Megatron-LM, Shoeybi et al. 2019; sequence parallelism, Korthikanti et al. 2022):

| style                 | weight (out, in)     | bias  | input                  | output                           |
|-----------------------|----------------------|-------|------------------------|----------------------------------|
| ``ColumnParallel()``  | S(0)                 | S(0)  | B (SP: S(seq) → gather) | S(-1)                            |
| ``QKVParallel(nh)``   | S(heads) of q, k, v  | same  | as ColumnParallel      | S(-1), whole heads per rank      |
| ``ColumnParallel(parts=k)`` | S(0) of each chunk | same | as ColumnParallel  | S(-1), a slice of every chunk    |
| ``RowParallel()``     | S(1)                 | B     | S(-1)                  | P → B all-reduce (SP: → S(seq))  |
| ``VocabParallel()``   | Embedding (v, h) S(0) | —     | B token ids            | P → B (SP: → S(seq))             |
|                       | Linear (v, h) S(0)   | —     | as ColumnParallel      | S(-1) vocab-sharded logits       |
| ``SequenceParallel()``| B, gradient P → B    | B     | S(seq)                 | S(seq) (``slice_output``: B → S)  |

Uneven features and vocabularies follow ``shard_sizes`` (the first ``size % tp`` ranks hold one more row);
attention heads must divide evenly by tp (a head is the unit of attention and is never cut).

Linear layers come in two weight layouts: ``nn.Linear``'s (out, in), y = x·Wᵀ + b, and the transposed (in, out),
y = x·W + b, of transformers' ``Conv1D`` (GPT-2). The column/row/QKV styles apply to both; the split dims above
swap for the transposed one (column: weight S(1); row: weight S(0)). A layer is recognised as linear by
``linear_layout``: ``nn.Linear``; a class named ``Conv1D`` with a 2-D (nx, nf) ``weight``; or any module with
a 2-D ``weight`` that declares ``weight_layout = "in_out"`` (or ``"out_in"``) and computes x·W + b (x·Wᵀ + b).
Its forward is replaced by the parallel module's, so it must compute exactly that.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Mapping, Sequence, Union

import torch
import torch.nn as nn

__all__ = ["linear_layout", "linear_dims", "ColumnParallel", "RowParallel", "VocabParallel", "QKVParallel", "SequenceParallel",
           "ContextParallel", "Style",
           "match_plan", "check_style"]


@dataclass(frozen=True, repr=False)
class ColumnParallel:
    """``nn.Linear`` split on its output features: weight S(0), bias S(0), output S(-1) (local features).

    ``heads``: when set, the output features are ``heads`` attention heads and the split must fall on head
    boundaries (``heads`` divisible by tp). For a *fused* q/k/v projection use ``QKVParallel``.

    ``parts``: the output is ``parts`` equal chunks used separately (a fused gate/up: h → [gate | up], chunked
    after): each chunk is split on its own features, so every rank holds the same slice of gate and of up (a
    naive column block would give one rank all of gate). Each chunk's width must divide by tp; with ``heads``,
    each chunk is ``heads`` heads."""

    heads: int | None = None
    parts: int = 1

    def __repr__(self) -> str:  # parts shown only when fused (plans print styles)
        return f"ColumnParallel(heads={self.heads}{f', parts={self.parts}' if self.parts != 1 else ''})"


@dataclass(frozen=True)
class QKVParallel:
    """A fused ``nn.Linear`` h → 3h whose output is [q | k | v], each ``n_head`` heads: every rank gets whole
    heads — the same heads' rows of q, k and v — not naive column blocks. The parent module's ``head_attr``
    (the attention's head count) is lowered to ``n_head / tp``, and each parent attribute named in
    ``divide_attrs`` is divided by tp (GPT-2's attention splits its output by ``split_size`` = h: pass
    ``head_attr="num_heads", divide_attrs=("split_size",)``). ``n_head`` must be divisible by tp."""

    n_head: int
    head_attr: str = "n_head"
    divide_attrs: tuple[str, ...] = ()


@dataclass(frozen=True)
class RowParallel:
    """``nn.Linear`` split on its input features: weight S(1); the input is the S(-1) output of a column-parallel
    layer; the partial output is all-reduced (sequence parallel: reduce-scattered on the sequence dim); the
    bias (B) is added once, after the reduction."""


@dataclass(frozen=True)
class VocabParallel:
    """Vocabulary split. On ``nn.Embedding``: rows S(0), masked lookup, partial output all-reduced (sequence
    parallel: reduce-scattered on the sequence dim). On ``nn.Linear`` (the LM head, possibly tied to the
    embedding): column-parallel over the vocabulary, logits stay vocab-sharded — compute the loss with
    ``vocab_parallel_cross_entropy``."""


@dataclass(frozen=True)
class SequenceParallel:
    """A module with replicated parameters that runs on sequence-split activations (LayerNorm, dropout): its
    parameters' gradients are partial sums over tp, summed with the other such parameters of its region (the
    enclosing ``ModuleList`` element, e.g. a block) by one all-reduce per backward (``grad_regions.py``).
    ``slice_output``: the module's output is computed in full from replicated input and this rank keeps its
    sequence slice along that dim (the position embedding: ``slice_output=0`` of its (t, h) output). Needs
    ``sequence_parallel=True``."""

    slice_output: int | None = None


@dataclass(frozen=True)
class ContextParallel:
    """Context parallelism for the whole model (key it by the root module, ``""``): ``sw.parallelize`` calls
    ``context_parallel(model, mesh, axis)`` after applying the tensor-parallel styles, so every
    ``scaled_dot_product_attention`` in the model runs as ring attention over ``axis`` and each rank feeds its
    two sequence chunks (``shard_sequence``). Not a tensor-parallel style: it splits no weight. ``sw.auto``
    puts it in a plan when the mesh has a cp axis and the model's attention can run on the ring."""

    axis: str = "cp"


Style = Union[ColumnParallel, QKVParallel, RowParallel, VocabParallel, SequenceParallel]
STYLES = (ColumnParallel, QKVParallel, RowParallel, VocabParallel, SequenceParallel)


def linear_layout(module: nn.Module) -> str | None:
    """``"out_in"`` (``nn.Linear``, y = x·Wᵀ + b), ``"in_out"`` (transposed: ``Conv1D``, y = x·W + b) or None
    when ``module`` is not a linear layer the tensor-parallel styles know. Pure; never imports transformers."""
    if isinstance(module, nn.Linear):
        return "out_in"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    declared = getattr(module, "weight_layout", None)
    if declared in ("in_out", "out_in"):
        return declared
    if type(module).__name__ == "Conv1D" and getattr(module, "nf", None) == weight.size(1):
        return "in_out"  # transformers.pytorch_utils.Conv1D: weight (nx, nf), y = addmm(b, x, W)
    return None


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in features, out features) of a layer ``linear_layout`` recognises. Pure."""
    w = module.weight
    return (w.size(0), w.size(1)) if linear_layout(module) == "in_out" else (w.size(1), w.size(0))


def match_plan(names: Sequence[str], plan: Mapping[str, Style]) -> dict[str, Style]:
    """``{module name: style}`` in module order. Pure. Raises ``ValueError`` for a pattern that matches no
    module or a module matched by two patterns with different styles, ``TypeError`` for a non-style value."""
    if not isinstance(plan, Mapping):
        raise TypeError(f"plan must map module-name patterns to styles, got {type(plan).__name__}")
    out: dict[str, Style] = {}
    for pattern, style in plan.items():
        if not isinstance(pattern, str):
            raise TypeError(f"plan keys are fnmatch patterns over module names, got {pattern!r}")
        if not isinstance(style, STYLES):
            raise TypeError(f"plan[{pattern!r}] must be one of {[s.__name__ for s in STYLES]}, got {style!r}")
        hits = [n for n in names if n and fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            sample = ", ".join(n for n in names[1:9] if n)
            raise ValueError(f"plan pattern {pattern!r} matches no module; module names look like: {sample}, ... "
                             f"(fnmatch over model.named_modules(), e.g. 'blocks.*.mlp.fc')")
        for name in hits:
            if name in out and out[name] != style:
                raise ValueError(f"module {name!r} is matched by two plan patterns with different styles "
                                 f"({out[name]} and {style}); make the patterns disjoint")
            out[name] = style
    return {n: out[n] for n in names if n in out}


def check_style(name: str, module: nn.Module, parent: nn.Module | None, style: Style, tp: int,
                sequence_parallel: bool) -> None:
    """Raise ``ValueError`` if ``style`` cannot apply to ``module`` at tp size ``tp``. Pure."""
    kind = type(module).__name__
    if isinstance(style, SequenceParallel):
        if not sequence_parallel:
            raise ValueError(f"{name}: SequenceParallel() needs parallelize(..., sequence_parallel=True); without "
                             f"sequence parallelism leave {name!r} out of the plan (it stays replicated)")
        return
    linear_only = isinstance(style, (ColumnParallel, QKVParallel, RowParallel))
    if linear_only and linear_layout(module) is None:
        raise ValueError(f"{name}: {type(style).__name__} applies to nn.Linear, got {kind} (or Conv1D, or a module "
                         f"declaring weight_layout='in_out'); match the Linear layers only (e.g. 'blocks.*.mlp.fc')")
    if isinstance(style, VocabParallel) and not isinstance(module, (nn.Linear, nn.Embedding)):
        raise ValueError(f"{name}: VocabParallel applies to nn.Embedding or an nn.Linear LM head, got {kind}")
    if isinstance(module, nn.Embedding) and (module.max_norm is not None or module.sparse):
        raise ValueError(f"{name}: VocabParallel does not support Embedding(max_norm=...) or sparse=True "
                         f"(got max_norm={module.max_norm}, sparse={module.sparse}); use a plain Embedding")
    if isinstance(style, ColumnParallel):
        _check_column(name, style, linear_dims(module)[1], tp)
    if isinstance(style, QKVParallel):
        _check_heads(name, style.n_head, linear_dims(module)[1], tp, fused=3)
        current = getattr(parent, style.head_attr, None)
        if current != style.n_head:
            raise ValueError(f"{name}: QKVParallel({style.n_head}) lowers the parent module's {style.head_attr!r} "
                             f"to n_head/tp, but the parent ({type(parent).__name__}) has "
                             f"{style.head_attr}={current!r}; pass head_attr= naming its head-count attribute")
        for attr in style.divide_attrs:
            value = getattr(parent, attr, None)
            if not isinstance(value, int) or value % tp:
                raise ValueError(f"{name}: QKVParallel divides the parent's {attr!r} by tp={tp}, but it is "
                                 f"{value!r}; name only int attributes divisible by tp in divide_attrs")


def _check_column(name: str, style: ColumnParallel, out_features: int, tp: int) -> None:
    if style.heads is not None:
        _check_heads(name, style.heads, out_features, tp, fused=style.parts)
    if not isinstance(style.parts, int) or style.parts < 1:
        raise ValueError(f"{name}: ColumnParallel(parts=...) must be a positive int, got {style.parts!r}")
    if style.parts > 1 and (out_features % style.parts or (out_features // style.parts) % tp):
        raise ValueError(f"{name}: ColumnParallel(parts={style.parts}) splits each of {style.parts} equal chunks "
                         f"of out_features={out_features} over tp={tp}; each chunk's width must divide by tp")


def _check_heads(name: str, n_head: int, out_features: int, tp: int, fused: int) -> None:
    if not isinstance(n_head, int) or n_head < 1:
        raise ValueError(f"{name}: the head count must be a positive int, got {n_head!r}")
    if out_features % (fused * n_head) != 0:
        raise ValueError(f"{name}: out_features={out_features} is not {fused} x {n_head} heads of equal width; "
                         f"check the head count")
    if n_head % tp != 0:
        raise ValueError(f"{name}: {n_head} attention heads do not divide over tp={tp}; heads are never cut "
                         f"(uneven splitting is not used for heads): choose tp dividing {n_head} or change n_head")
