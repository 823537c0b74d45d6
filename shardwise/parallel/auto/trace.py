"""Trace a model once on its example inputs into a small dataflow graph of its parameterised modules.

No ``torch.fx``/``torch.export`` (both fail on models with data-dependent Python, e.g. transformers v5): the
model simply runs forward once, under ``torch.no_grad``, while

* forward hooks on every *unit* (a module holding parameters directly — ``nn.Linear``, ``nn.Embedding``, a
  norm — and not inside another unit) record the call order, the input/output shapes and which earlier nodes
  the inputs came from, and stamp the outputs as the unit's own;
* a ``TorchFunctionMode`` carries those stamps through every other op: an op's outputs come from the union
  of its tensor inputs' sources. An op that combines values of *different* sources (a residual add, the
  ``silu(gate) * up`` product, ``q @ kᵀ``) becomes a **join** node, so the residual stream is a chain of
  joins rather than an ever-growing set of sources.

Structure assumed (and where it fails):

* Values without a source (masks, position ids, rotary tables, constants) are broadcast-compatible with any
  layout of the values they meet. A *learned* tensor outside a unit is inside the unit that owns it.
* Between a unit and its consumers the ops act per feature, per attention head or per token (activations,
  gating, attention over whole heads, reshapes that keep heads whole). An op that mixes features between a
  column-split output and the row layer that consumes it (a softmax or functional norm over the feature dim)
  is not seen, and a plan splitting across it would be wrong: pin one side to ``"B"`` and check the plan
  with ``shardwise verify``.
* Control flow is whatever this one forward took (data-dependent branches are traced as taken).

Every ``F.scaled_dot_product_attention`` call is recorded too (``Graph.attention``: its query shape, whether
it got a mask tensor, its dropout and causality), for ``sw.auto``'s context-parallel decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["Node", "Graph", "Attention", "trace_graph", "call_model"]

_SDPA = F.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass
class Node:
    """One unit call or one join in call order; ``preds`` are earlier node indices its inputs came from."""

    index: int
    kind: str
    """``module`` or ``join``."""
    name: str
    """The module's name in ``named_modules()`` (``join@<index>`` for joins)."""
    preds: tuple[int, ...]
    out_shape: tuple[int, ...]
    in_shape: tuple[int, ...] = ()
    module: nn.Module | None = None
    sink: bool = False
    """Its value reaches the model's output."""
    succs: list[int] = field(default_factory=list)
    parts: int = 1
    """Into how many equal chunks its output is cut on the last dim (``split``/``chunk``) by a consumer: > 1 for
    a fused projection ([q | k | v], [gate | up]), whose chunks must each be split on their own; 0 when the
    chunks differ in width (grouped-query [q | k | v]): no column split keeps them whole."""


@dataclass(frozen=True)
class Attention:
    """One ``F.scaled_dot_product_attention`` call of the traced forward."""

    query_shape: tuple[int, ...]
    """``(..., heads, sequence, head dim)``: the sequence is ``query_shape[-2]``."""
    mask: bool
    """It got an ``attn_mask`` tensor."""
    dropout_p: float
    is_causal: bool

    @property
    def seq(self) -> int:
        return self.query_shape[-2] if len(self.query_shape) >= 2 else 0


@dataclass
class Graph:
    nodes: list[Node]
    params: dict[str, list[tuple[str, nn.Parameter]]]
    """Unit name -> its parameters (own and descendants'), for sizes and tied-weight detection."""
    attention: list[Attention] = field(default_factory=list)
    """The forward's ``scaled_dot_product_attention`` calls, in order."""

    def units(self) -> list[Node]:
        return [n for n in self.nodes if n.kind == "module"]


def call_model(model: nn.Module, example_inputs: Any) -> Any:
    """Run ``model`` on ``example_inputs``: a tuple/list of positional args, a dict of keyword args, or one
    tensor. ``TypeError`` for anything else."""
    if isinstance(example_inputs, torch.Tensor):
        return model(example_inputs)
    if isinstance(example_inputs, Mapping):
        return model(**example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return model(*example_inputs)
    raise TypeError(f"example_inputs must be a tuple of positional args, a dict of keyword args or a tensor, got "
                    f"{type(example_inputs).__name__}; e.g. example_inputs=(input_ids,)")


def _tensors(obj: Any) -> list[torch.Tensor]:
    if hasattr(obj, "to_tuple") and callable(obj.to_tuple):  # transformers' ModelOutput
        obj = obj.to_tuple()
    leaves, _ = tree_flatten(obj)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


class _Tracer(TorchFunctionMode):
    """Carries node stamps through ops; creates join nodes where different sources meet."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.source: dict[int, int] = {}  # id(tensor) -> node index
        self.alive: list[torch.Tensor] = []  # keeps stamped tensors alive so their ids stay unique
        self.inside = 0  # > 0 while a unit runs: its internals are its own business (no stamps, no joins)
        self.attention: list[Attention] = []

    def stamp(self, tensors: Iterable[torch.Tensor], node: int) -> None:
        for t in tensors:
            self.source[id(t)] = node
            self.alive.append(t)

    def sources(self, obj: Any) -> tuple[int, ...]:
        return tuple(sorted({self.source[id(t)] for t in _tensors(obj) if id(t) in self.source}))

    def add(self, kind: str, name: str, preds: tuple[int, ...], out: Any, **kw: Any) -> int:
        outs = _tensors(out)
        shape = tuple(outs[0].shape) if outs else ()
        node = Node(len(self.nodes), kind, name if kind == "module" else f"join@{len(self.nodes)}", preds, shape, **kw)
        self.nodes.append(node)
        self.stamp(outs, node.index)
        return node.index

    def note_chunks(self, func: Any, args: Any, kwargs: dict, out: Any, pred: int) -> None:
        """Record a module's output cut into equal chunks on its last (feature) dim: ``x.split(h, dim=-1)``,
        ``x.chunk(k, -1)``, as a fused projection's consumer does."""
        if getattr(func, "__name__", "") not in ("split", "chunk", "tensor_split") or not isinstance(out, (tuple, list)):
            return
        x, node = args[0] if args else None, self.nodes[pred]
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 0)
        if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or node.kind != "module" or len(out) < 2:
            return
        if dim % x.dim() == x.dim() - 1 and x.size(-1) == node.out_shape[-1]:
            even = len({o.shape for o in out}) == 1
            node.parts = 0 if not even or node.parts == 0 else max(node.parts, len(out))

    def note_attention(self, args: Any, kwargs: dict) -> None:
        bound = dict(zip(_SDPA_ARGS, args), **kwargs)
        q, mask = bound.get("query"), bound.get("attn_mask")
        self.attention.append(Attention(tuple(q.shape) if isinstance(q, torch.Tensor) else (), mask is not None,
                                        float(bound.get("dropout_p", 0.0) or 0.0), bool(bound.get("is_causal"))))

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            self.note_attention(args, kwargs)
        out = func(*args, **kwargs)
        if self.inside:
            return out
        preds = self.sources((args, kwargs))
        if len(preds) == 1:
            self.note_chunks(func, args, kwargs, out, preds[0])
            self.stamp(_tensors(out), preds[0])
        elif len(preds) > 1 and _tensors(out):
            self.add("join", "", preds, out)
        return out


def _units(model: nn.Module) -> dict[str, nn.Module]:
    """Modules holding parameters directly, outermost first; their descendants belong to them."""
    out: dict[str, nn.Module] = {}
    for name, mod in model.named_modules():
        if any(name == u or name.startswith(u + ".") for u in out if u):
            continue
        if next(mod.parameters(recurse=False), None) is not None:
            out[name] = mod
    return out


def trace_graph(model: nn.Module, example_inputs: Any) -> Graph:
    """Run ``model`` once on ``example_inputs`` (no gradients) and return its unit/join graph. Local."""
    units = _units(model)
    if "" in units:
        raise ValueError(f"{type(model).__name__} holds parameters directly on the root module; sw.auto plans per "
                         f"submodule: move them into a submodule (e.g. an nn.Linear or nn.Embedding)")
    tracer = _Tracer()
    hooks = []
    for name, mod in units.items():
        def pre(_m: nn.Module, args: Any, kwargs: Any, name: str = name) -> None:
            tracer._pending = (tracer.sources((args, kwargs)), _tensors((args, kwargs)))  # type: ignore[attr-defined]
            tracer.inside += 1

        def post(m: nn.Module, _a: Any, _k: Any, out: Any, name: str = name) -> None:
            preds, ins = tracer._pending  # type: ignore[attr-defined]
            tracer.inside -= 1
            in_shape = tuple(ins[0].shape) if ins else ()
            tracer.add("module", name, preds, out, in_shape=in_shape, module=m)
        hooks.append(mod.register_forward_pre_hook(pre, with_kwargs=True))
        hooks.append(mod.register_forward_hook(post, with_kwargs=True))
    try:
        with torch.no_grad(), tracer:
            out = call_model(model, example_inputs)
    finally:
        for h in hooks:
            h.remove()
    for i in tracer.sources(out):
        tracer.nodes[i].sink = True
    for node in tracer.nodes:
        for p in node.preds:
            tracer.nodes[p].succs.append(node.index)
    params = {n: list(m.named_parameters(remove_duplicate=False)) for n, m in units.items()}
    return Graph(tracer.nodes, params, tracer.attention)
