"""``sw.parallelize``: tensor (model) parallelism from a declarative plan (module-name pattern → style).

    plan = sw.gpt_plan(config, sequence_parallel=True)   # a dict pattern -> style; sw.auto gives a ParallelizePlan
    model = sw.parallelize(GPT(config), mesh, plan, axis="tp", sequence_parallel=True)
    logits = model(idx)                              # (b, t, V/tp): vocab-sharded, never gathered
    loss = sw.vocab_parallel_cross_entropy(logits, targets, mesh=mesh, axis="tp")
    loss.backward(); opt.step()                      # optimizer built *after* parallelize

Planned modules are replaced by the modules of ``modules.py``, which hold this rank's shard as an
ordinary ``nn.Parameter`` under the original name (state_dict keys unchanged). Each sharded parameter carries
its global description (``sbp.params.annotate``: ``as_global(p)`` is its ``GlobalTensor`` view), and
``sw.full_state_dict(model)`` returns the full tensors under the single-device keys. Tied parameters (the LM
head and the embedding) stay one Parameter: both uses must shard it the same way.

``parallelize`` never communicates: it validates the whole plan first (``ValueError``/``TypeError`` naming
the module, the constraint and the fix), then slices locally. It assumes every tp rank holds the same full
model (build it from the same seed). Forward and backward of the model are collective over ``axis``.
"""

from __future__ import annotations

import types
from typing import Mapping

import torch
import torch.nn as nn

from ...comm.ops import ALGORITHM_CHOICES
from ...mesh import Mesh
from ..common.materialize import ensure_sources
from ...sbp.global_tensor import GlobalTensor, distribute, to_global
from ...sbp.params import as_global, spec_of
from ...sbp.placement import Replicate, Split
from .grad_regions import build_regions
from .lora import apply_lora_style, base_of, is_lora_layer, lora_matches
from .model_loss import install_model_loss
from .modules import (ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding,
                             VocabParallelHead, heads_local_shape, shard_heads, shard_param)
from .rng import RNGStreams
from .styles import (ColumnParallel, ContextParallel, QKVParallel, RowParallel, SequenceParallel, Style,
                     VocabParallel, check_style, linear_dims, linear_layout, match_plan)
from .vocab_loss import vocab_parallel_cross_entropy

__all__ = ["parallelize", "gpt_plan", "vocab_parallel_cross_entropy", "global_view", "split_axes", "full_tensor",
           "local_piece", "ColumnParallel", "RowParallel", "VocabParallel", "QKVParallel", "SequenceParallel",
           "ContextParallel"]

_MARK = "_shardwise_tensor_parallel"


def gpt_plan(config: object, sequence_parallel: bool = False) -> dict[str, Style]:
    """The tensor-parallel plan of a model that carries one: ``config`` is a ``GPTConfig`` or a ``GPT`` (anything
    with ``tensor_parallel_plan(sequence_parallel)``). The plan itself lives with the model
    (``shardwise.models.gpt``); this name stays for existing callers."""
    plan_of = getattr(config, "tensor_parallel_plan", None)
    if not callable(plan_of):
        raise TypeError(f"gpt_plan expects a GPTConfig or a GPT (something with tensor_parallel_plan()), got "
                        f"{type(config).__name__}; write the plan as a dict of pattern -> style instead")
    return plan_of(sequence_parallel=sequence_parallel)


def parallelize(model: nn.Module, mesh: Mesh, plan: Mapping[str, Style], *, axis: str | None = None,
                sequence_parallel: bool = False, seed: int | None = None, algorithm: str = "native",
                async_tp: bool = False) -> nn.Module:
    """Shard ``model`` in place over ``axis`` of ``mesh`` following ``plan``; returns it (see module doc).

    ``sequence_parallel``: activations outside column→row pairs are split on the sequence dim (dim 1);
    every trainable parameter outside the sharded layers must then be covered by ``SequenceParallel()``
    (its gradient is a partial sum over ``axis``; the partial-gradient parameters of each region — a
    ``ModuleList`` element such as a block, else the module itself — are summed by one all-reduce per
    backward, ``grad_regions.py``). ``seed``: mixed with a
    draw from the shared stream and the tp coord to seed each split region's dropout (``tensor_rng.py``;
    default ``torch.initial_seed()``). ``algorithm``: the implementation of every tp collective the model
    runs (``native | ring | tree | shm | auto``, see ``sw.comm``; ``shm`` for CPU ranks on one host). Local
    (no communication); raises before changing anything. ``axis`` defaults to the plan's ``tp_axis`` (an
    ``sw.auto`` plan), else ``"tp"``. A ``ContextParallel(axis=...)`` entry keyed by the root module ``""``
    (what ``sw.auto`` gives on a mesh with a cp axis) is applied last, as ``context_parallel(model, mesh, axis)``;
    with no other entry, no tensor-parallel axis is needed. ``async_tp``: overlap the column and row layers'
    collectives with their matmuls (``overlap.py``: with sequence parallelism the all-gather and the
    reduce-scatter as rings of sequence chunks, one chunk matmul per hop; without it the row layers' all-reduce
    in pieces and the column layers' backward all-reduce under their weight gradients); same values up to the
    order of floating-point sums, same bytes. A no-op on a tp axis of size 1.
    """
    cp = {k: v for k, v in plan.items() if isinstance(v, ContextParallel)} if isinstance(plan, Mapping) else {}
    if cp:
        return _with_context(model, mesh, plan, cp, axis=axis, sequence_parallel=sequence_parallel, seed=seed,
                             algorithm=algorithm, async_tp=async_tp)
    experts, rest = _split_experts(plan)
    if experts:
        return _with_experts(model, mesh, experts, rest, axis=axis, sequence_parallel=sequence_parallel, seed=seed,
                             algorithm=algorithm, async_tp=async_tp)
    axis = axis if axis is not None else (getattr(plan, "tp_axis", None) or "tp")
    _check_call(model, mesh, axis)
    if not isinstance(async_tp, bool):
        raise TypeError(f"async_tp must be a bool (overlap the tp collectives with the matmuls), got {async_tp!r}")
    ensure_sources(model)  # a meta-device model: the sharded layers read their pieces, the rest stays meta
    if algorithm not in ALGORITHM_CHOICES:
        raise ValueError(f"unknown algorithm {algorithm!r} for the tensor-parallel collectives; choose one of "
                         f"{list(ALGORITHM_CHOICES)}")
    names = [n for n, _ in model.named_modules()]
    modules = dict(model.named_modules())
    matched = lora_matches(match_plan(names, plan), modules)
    tp = mesh.size(axis)
    for name, style in matched.items():  # a LoRA layer (lora.py) is checked as its base
        check_style(name, base_of(modules[name]), modules.get(name.rpartition(".")[0]), style, tp, sequence_parallel)
    _check_coverage(model, matched, sequence_parallel)
    rng = RNGStreams(mesh.device, torch.initial_seed() if seed is None else seed, mesh.coord(axis))
    ctx = TPContext(mesh, axis, sequence_parallel, rng, algorithm=algorithm, async_tp=async_tp)
    shared: dict[int, tuple[str, nn.Parameter]] = {}
    partial: list[tuple[str, nn.Module, list[str]]] = []  # (module name, module, its partial-gradient params)
    for name, style in matched.items():
        _apply(model, name, modules[name], style, ctx, shared, partial)
        if isinstance(style, VocabParallel) and isinstance(modules[name], nn.Linear):
            install_model_loss(model, name, ctx)  # model(..., labels=...).loss over the split logits
    ctx.regions = build_regions(model, partial, mesh, axis, algorithm)
    model.register_forward_pre_hook(lambda *_: _enter(ctx))
    model.register_forward_hook(lambda *_: _leave(ctx), always_call=True)
    setattr(model, _MARK, ctx)
    model.full_state_dict = types.MethodType(_full_state_dict, model)  # type: ignore[method-assign]
    return model


def _with_context(model: nn.Module, mesh: Mesh, plan: Mapping[str, Style], cp: dict[str, ContextParallel], *,
                  axis: str | None, **kw: object) -> nn.Module:
    """``parallelize`` of a plan with a ``ContextParallel`` entry: the tensor-parallel styles (if any), then
    ``context_parallel`` over the entry's axis. Validates the entry before changing anything."""
    from ..context.wrap import context_parallel

    if set(cp) != {""} or len(set(cp.values())) != 1:
        raise ValueError(f"ContextParallel applies to the whole model: key it by the root module '' (plan[''] = "
                         f"ContextParallel(axis='cp')), got patterns {sorted(cp)}")
    style = cp[""]
    if not isinstance(mesh, Mesh) or style.axis not in mesh.axes:
        raise ValueError(f"ContextParallel(axis={style.axis!r}): not an axis of the mesh "
                         f"{list(getattr(mesh, 'axes', ()))}; use one of its axes")
    if getattr(model, "_shardwise_context_parallel", None) is not None:
        raise ValueError("context_parallel was already applied to this model; parallelize the plain model once")
    rest = {k: v for k, v in plan.items() if not isinstance(v, ContextParallel)}
    tp_axis = axis if axis is not None else getattr(plan, "tp_axis", None)
    if tp_axis == style.axis:
        raise ValueError(f"the tensor-parallel axis and the context-parallel axis are both {style.axis!r}; "
                         f"give each its own mesh axis")
    if rest:
        parallelize(model, mesh, rest, axis=tp_axis or "tp", **kw)  # type: ignore[arg-type]
    return context_parallel(model, mesh, style.axis)


def _split_experts(plan: object) -> tuple[dict, object]:
    """(the ``ExpertParallel`` entries, the rest) of a plan (``parallel/expert/style.py``)."""
    from ..expert.style import split_plan  # noqa: PLC0415 (the expert style's module imports this package's)

    return split_plan(plan) if isinstance(plan, Mapping) else ({}, plan)


def _with_experts(model: nn.Module, mesh: Mesh, experts: dict, rest: dict, *, axis: str | None,
                  algorithm: str, **kw: object) -> nn.Module:
    """``parallelize`` of a plan with ``ExpertParallel`` entries (``parallel/expert/style.py``): all checked
    before anything changes, the other styles applied, then the experts split over the same axis."""
    from ..expert.style import apply_expert_parallel, match_experts  # noqa: PLC0415

    axis = axis if axis is not None else (getattr(rest, "tp_axis", None) or "tp")
    _check_call(model, mesh, axis)
    if algorithm not in ALGORITHM_CHOICES:
        raise ValueError(f"unknown algorithm {algorithm!r} for the expert-parallel collectives; choose one of "
                         f"{list(ALGORITHM_CHOICES)}")
    names = match_experts(model, experts, mesh.size(axis))
    if rest:
        parallelize(model, mesh, rest, axis=axis, algorithm=algorithm, **kw)  # type: ignore[arg-type]
    for name in names:
        apply_expert_parallel(model, name, mesh, axis, algorithm)
    return model


def _enter(ctx: TPContext) -> None:
    """The root's forward pre-hook: start the forward in the right RNG region and put the regions' swap-in
    hooks behind any pre-hook added since ``parallelize`` (ZeRO-3's gathers). Local."""
    ctx.forget_input()
    if ctx.sequence_parallel:
        ctx.rng.enter_split()
    else:
        ctx.rng.leave_split()
    for region in ctx.regions:
        region.hooks_last()


def _leave(ctx: TPContext) -> None:
    """The root's forward hook (returns None: a value would replace the model's output)."""
    ctx.rng.leave_split()
    ctx.forget_input()


def _check_call(model: nn.Module, mesh: Mesh, axis: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize expects an nn.Module, got {type(model).__name__}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a shardwise.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axes:
        raise ValueError(f"axis {axis!r} is not a mesh axis; the mesh has {list(mesh.axes)}")
    if getattr(model, _MARK, None) is not None:
        raise ValueError(f"{type(model).__name__} is already tensor-parallel; parallelize the plain model once")
    if getattr(model, "_shardwise_data_parallel", False) or isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError(f"{type(model).__name__} is a wrapper; call parallelize on the plain model first, then "
                         f"wrap it (e.g. sw.DataParallel(sw.parallelize(model, ...), mesh, axis='dp'))")


def _sharded_params(module: nn.Module, style: Style) -> list[str]:
    """Names (in ``module``) of the parameters that ``style`` shards (SequenceParallel: none)."""
    if is_lora_layer(module):  # the base's, under its name in the LoRA layer (the adapter's follow it)
        return [f"base_layer.{n}" for n in _sharded_params(module.base_layer, style)]
    if isinstance(style, SequenceParallel):
        return []
    if isinstance(style, RowParallel):
        return ["weight"]  # its bias stays replicated
    return [n for n in ("weight", "bias") if getattr(module, n, None) is not None]


def _check_coverage(model: nn.Module, matched: dict[str, Style], sequence_parallel: bool) -> None:
    """Every use of a sharded (possibly tied) parameter must be by a planned module that shards it; with
    sequence parallelism every other trainable parameter needs ``SequenceParallel``. Pure."""
    owners: dict[int, list[str]] = {}
    for full_name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(full_name)
    sharded: set[str] = set()
    covered: set[str] = set()
    for name, style in matched.items():
        module = model.get_submodule(name)
        sharded |= {f"{name}.{p}" for p in _sharded_params(module, style)}
        covered |= {f"{name}.{p}" for p, _ in module.named_parameters()}
    for uses in owners.values():
        hit = [u for u in uses if u in sharded]
        if hit and len(hit) != len(uses):
            missing = [u for u in uses if u not in sharded]
            raise ValueError(f"parameter {hit[0]!r} is shared with {missing} (tied weights), which the plan leaves "
                             f"unsharded; give those modules a style that shards it the same way")
    if sequence_parallel:
        loose = [n for n, p in model.named_parameters() if p.requires_grad and n not in covered]
        if loose:
            raise ValueError(f"with sequence_parallel=True every trainable parameter outside the sharded layers "
                             f"acts on sequence-split activations and needs SequenceParallel() in the plan; "
                             f"uncovered: {loose[:6]}{' ...' if len(loose) > 6 else ''}")


def _apply(model: nn.Module, name: str, module: nn.Module, style: Style, ctx: TPContext,
           shared: dict[int, tuple[str, nn.Parameter]], partial: list[tuple[str, nn.Module, list[str]]]) -> None:
    """Replace (or hook) one planned module; append the modules whose parameters get partial gradients
    (sequence parallelism) to ``partial``. Local."""
    if isinstance(style, SequenceParallel):
        _sequence_parallel(module, style, ctx)
        partial.append((name, module, [n for n, _ in module.named_parameters(remove_duplicate=False)]))
        return
    if is_lora_layer(module):
        apply_lora_style(name, module, style, ctx, lambda n, m: _apply(model, n, m, style, ctx, shared, partial),
                         partial)
        return
    tp = ctx.mesh.size(ctx.axis)
    transposed = linear_layout(module) == "in_out"  # Conv1D: weight (i, o), the split dims swap
    fused = _fused_units(module, style)  # (chunks, units per chunk) split whole, or None

    def shard(p: torch.Tensor | None, dim: int | None, key: str) -> nn.Parameter | None:
        if p is None:
            return None
        if id(p) in shared:
            if shared[id(p)][0] != key:
                raise ValueError(f"{name}: a tied parameter is sharded two ways ({shared[id(p)][0]} and {key}); "
                                 f"tied uses must split it identically")
            return shared[id(p)][1]
        if fused is not None:
            new = shard_heads(p, ctx, fused[0], fused[1], dim=1 if transposed and p.dim() == 2 else 0)
        else:
            new = shard_param(p, ctx, dim if dim is None or p.dim() == 1 or not transposed else 1 - dim)
        shared[id(p)] = (key, new)
        return new

    if isinstance(module, nn.Embedding):
        new: nn.Module = VocabParallelEmbedding(shard(module.weight, 0, "S(0)"), ctx, module.num_embeddings,
                                                module.padding_idx)
    elif isinstance(style, RowParallel):
        bias = shard(module.bias, None, "B")
        new = RowParallelLinear(shard(module.weight, 1, "S(1)"), bias, ctx, linear_dims(module)[0], transposed)
        if bias is not None and ctx.sequence_parallel:
            partial.append((name, new, ["bias"]))  # added to sequence-split activations: partial gradient
    else:
        cls = VocabParallelHead if isinstance(style, VocabParallel) else ColumnParallelLinear
        key = f"heads/{tp}/{fused}" if fused is not None else "S(0)"
        new = cls(shard(module.weight, 0, key), shard(module.bias, 0, key), ctx, linear_dims(module)[1], transposed)
        if isinstance(style, QKVParallel):
            parent = model.get_submodule(name.removesuffix(".base_layer").rpartition(".")[0])
            setattr(parent, style.head_attr, style.n_head // tp)
            for attr in style.divide_attrs:  # e.g. GPT-2's split_size: the width of each of q, k, v
                setattr(parent, attr, getattr(parent, attr) // tp)
    new.train(module.training)
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def _fused_units(module: nn.Module, style: Style) -> tuple[int, int] | None:
    """(chunks, units per chunk) when ``style`` splits each chunk of the output on its own, whole units (heads,
    or single features) per rank: QKVParallel (3, n_head); ColumnParallel(parts=k) (k, heads or features per
    chunk). None for a plain contiguous split."""
    if isinstance(style, QKVParallel):
        return 3, style.n_head
    if isinstance(style, ColumnParallel) and style.parts > 1:
        return style.parts, style.heads if style.heads is not None else linear_dims(module)[1] // style.parts
    return None


def _sequence_parallel(module: nn.Module, style: SequenceParallel, ctx: TPContext) -> None:
    """With ``slice_output``, keep this rank's sequence slice of the module's output. (Its parameters'
    partial gradients are summed by the module's gradient region, ``grad_regions.py``.)"""
    if style.slice_output is not None:
        dim = style.slice_output

        def keep_slice(_m: nn.Module, _inp: object, out: torch.Tensor) -> torch.Tensor:
            start, length = ctx.split_sequence(out.size(dim))
            return out.narrow(dim, start, length)  # backward: zeros elsewhere -> partial gradient
        module.register_forward_hook(keep_slice)


def global_view(param: torch.Tensor, local: torch.Tensor | None = None) -> GlobalTensor | None:
    """The ``GlobalTensor`` of a parallelized parameter (over ``local``, a tensor of the param's local shape
    holding other values, e.g. its gathered ZeRO shard; default the param itself). Head-split (QKV)
    parameters are presented as their (3, nh·hd, ...) view split S(1), the one layout in which whole heads
    are a plain split. None if plain."""
    heads = getattr(param, "_shardwise_heads", None)
    if heads is None:
        g = as_global(param)
        return g if g is None or local is None else to_global(local, g.mesh, g.spec.sbp, shape=g.spec.shape)
    local = param if local is None else local
    mesh, view, sbp = _heads_view(heads)
    return to_global(local.reshape(view[0], -1, *view[2:]), mesh, sbp, shape=view)


def _heads_view(heads: tuple) -> tuple[Mesh, tuple[int, ...], list]:
    """``(mesh, view shape, sbp)`` of a head-split parameter (``_shardwise_heads``): its view — (fused, nh·hd, ...),
    or (i·fused, nh·hd) for a transposed weight — split S(1) over the tp axis (whole heads), B elsewhere."""
    mesh, axis, _fused, _full_shape, view = heads[:5]
    sbp = [Split(1) if a == axis else Replicate() for a in mesh.axes]
    return mesh, tuple(view), sbp


def split_axes(param: torch.Tensor) -> set[str]:
    """The mesh axes a parallelized parameter is split over (empty for a replicated or plain one). Reads only
    the parameter's layout, never its data (a ZeRO stage-3 parameter may be freed). Pure."""
    heads = getattr(param, "_shardwise_heads", None)
    if heads is not None:
        return {heads[1]}
    spec = spec_of(param)
    return set() if spec is None else {a for a, p in zip(spec.axes, spec.sbp) if isinstance(p, Split)}


def full_tensor(param: torch.Tensor, local: torch.Tensor | None = None) -> torch.Tensor:
    """The full value under the plain model's shape of ``local`` (default ``param``) laid out like ``param``:
    gathered over the axes ``param`` is split on; ``local`` itself for a plain tensor. Collective over those
    axes (every rank of them calls it for the same tensors in the same order)."""
    g = global_view(param, local)
    if g is None:
        return (param if local is None else local).detach()
    heads = getattr(param, "_shardwise_heads", None)
    full = g.full().detach()
    return full.reshape(heads[3]) if heads is not None else full


def local_piece(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` (the plain model's shape) laid out like ``param``: the inverse of
    ``full_tensor``; ``full`` itself for a plain tensor. Local (a slice, no communication)."""
    heads = getattr(param, "_shardwise_heads", None)
    if heads is not None:
        mesh, view, sbp = _heads_view(heads)  # local: (fused·nh/tp·hd, ...), transposed (i, fused·nh/tp·hd)
        return distribute(full.reshape(view), mesh, sbp).to_local().reshape(heads_local_shape(heads))
    spec = spec_of(param)
    if spec is None:
        return full
    return distribute(full.reshape(spec.shape), as_global(param).mesh, spec.sbp).to_local()


def _full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors under the single-device keys (installed as ``model.full_state_dict``; used by
    ``sw.full_state_dict``). Collective over the mesh: every rank must call it."""
    return {key: full_tensor(value) if isinstance(value, torch.Tensor) else value
            for key, value in model.state_dict(keep_vars=True).items()}
