"""The layouts each traced node may take on the tensor-parallel axis, with their prices.

Activations are split on the batch over every data axis; on the tp axis a value is ``B`` (replicated) or
``Sf`` (split on its last dim: features, or whole heads). A node's option says what it needs (``need``) and
what it delivers (``gives``); a plan is feasible when every node's inputs are delivered as it needs them —
exactly the transitions ``sw.parallelize`` performs (a row layer's partial output is all-reduced inside it,
a column layer's replicated input gets its gradient all-reduced in backward):

| kind     | module                    | weight on tp | need | gives | communication priced (boxing router)           |
|----------|---------------------------|--------------|------|-------|------------------------------------------------|
| ``B``    | any unit                  | B            | B    | B     | none on tp (compute not divided)               |
| column   | ``nn.Linear``             | S(0)         | B    | Sf    | backward: input gradient P -> B                |
| row      | ``nn.Linear``             | S(1)         | Sf   | B     | forward: output P -> B                         |
| column/row | transposed (``Conv1D``) | S(1) / S(0)  | as ``nn.Linear``   | same as ``nn.Linear``            |
| vocab    | ``nn.Embedding``          | S(0)         | any  | B     | forward: output P -> B                         |
| vocab    | ``nn.Linear``, model output | S(0)       | B    | Sf    | backward input gradient; the loss's two (N,) all-reduces |
| ``B``/``Sf`` | join (residual add, gating, attention core) | — | = | =  | none (all inputs must agree)                   |
| experts  | an MoE's 3-D experts module (``expert_kind``) | S(0) (experts) | B | B | forward: output P -> B; backward: input gradient P -> B |

A unit that reads the model's own input (no traced node feeds it) is offered no option needing ``Sf`` (row):
that input is whole on every rank (``_input_rule``). A value leaving the model must be whole, except
vocabulary-split logits (``_sink_rule``).

A fused projection (its output cut into equal chunks by ``split``/``chunk``, ``trace.Node.parts``) is offered
column only as a split of every chunk: ``QKVParallel`` for h -> 3h under a head count (``n_head`` or
``num_heads``), ``ColumnParallel(parts=k)`` otherwise.

Every unit also pays its gradient all-reduce over the data axes (in buckets) and ``STATE_COPIES`` times its
parameter bytes plus its output's bytes of memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.nn as nn

from ..expert.style import ExpertParallel, expert_kind
from ..tensor.styles import ColumnParallel, QKVParallel, RowParallel, Style, VocabParallel, linear_dims, linear_layout
from .cost import STATE_COPIES, CostModel
from .trace import Graph, Node

__all__ = ["Option", "NodeOptions", "node_options", "applicable", "KINDS"]

KINDS = ("B", "column", "row", "vocab")


@dataclass(frozen=True)
class Option:
    kind: str
    """``B``, ``column``, ``row``, ``vocab``, ``experts`` (units) or ``B``/``Sf`` (joins)."""
    style: Style | None
    need: str
    """What its inputs must be on tp: ``B``, ``Sf`` or ``any``."""
    gives: str
    time_s: float
    memory: float
    parts: tuple[tuple[str, float], ...] = ()
    """Breakdown of ``time_s``: compute, tp communication, gradient all-reduce."""


@dataclass
class NodeOptions:
    options: list[Option]
    unavailable: dict[str, str] = field(default_factory=dict)
    """kind -> why it cannot apply (for pins)."""


def _bytes(shape: tuple[int, ...], cm: CostModel, div: int = 1) -> float:
    return math.prod(shape) * cm.itemsize / cm.d / div


def _option(kind: str, style: Style | None, need: str, gives: str, compute: float, comm: float, grad: float,
            memory: float) -> Option:
    return Option(kind, style, need, gives, compute + comm + grad, memory,
                  (("compute", compute), ("tp comm", comm), ("grad all-reduce", grad)))


def _param_bytes(graph: Graph, node: Node, cm: CostModel) -> float:
    return sum(p.numel() for _, p in graph.params[node.name]) * cm.itemsize


def _heads(node: Node, parent: nn.Module | None, features: int, t: int) -> tuple[int | None, str | None]:
    """(heads, None) when ``features`` are attention heads of the parent (``head_dim``); (None, why) when a
    split over ``t`` would cut a head; (None, None) when the features are not heads."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0 or features % head_dim:
        return None, None
    heads = features // head_dim
    if heads % t:
        return None, f"its {heads} attention heads (head_dim={head_dim}) do not divide over tp={t}"
    return heads, None


def _head_attr(parent: nn.Module | None) -> tuple[str | None, int | None]:
    """The parent's head-count attribute and value: ``n_head`` (reference GPT) or ``num_heads`` (GPT-2)."""
    for attr in ("n_head", "num_heads"):
        value = getattr(parent, attr, None)
        if isinstance(value, int):
            return attr, value
    return None, None


def _fused_column(node: Node, parent: nn.Module | None, i: int, o: int, t: int,
                  out: NodeOptions) -> Style | None:
    """The column style of a fused projection (``node.parts`` > 1 chunks, or h -> 3h under ``n_head``)."""
    attr, n_head = _head_attr(parent)
    if n_head is not None and o == 3 * i and (node.parts in (1, 3)) and (attr == "n_head" or node.parts == 3):
        if n_head % t:
            out.unavailable["column"] = f"its {n_head} fused heads do not divide over tp={t}"
            return None
        split = getattr(parent, "split_size", None)  # GPT-2 cuts [q | k | v] by split_size = h
        return QKVParallel(n_head, head_attr=attr, divide_attrs=("split_size",) if split == i else ())
    parts = node.parts
    heads, why = _heads(node, parent, o // parts, t)
    if o % parts or (o // parts) % t or why:
        out.unavailable["column"] = why or f"its {parts} fused chunks of {o // parts} features do not divide over tp={t}"
        return None
    return ColumnParallel(heads=heads, parts=parts)


def _linear_splits(node: Node, mod: nn.Module, parent: nn.Module | None, cm: CostModel,
                   out: NodeOptions) -> tuple[Style | None, bool]:
    """The column style (or None, reason recorded) and whether row applies."""
    (i, o), t = linear_dims(mod), cm.t
    col: Style | None = None
    n_head = getattr(parent, "n_head", None)
    if node.parts == 0:
        out.unavailable["column"] = "its output is cut into chunks of different widths (fused grouped-query q/k/v)"
    elif node.parts > 1 or (isinstance(n_head, int) and o == 3 * i):  # a fused projection
        col = _fused_column(node, parent, i, o, t, out)
    elif isinstance(n_head, int):
        out.unavailable["column"] = (f"its parent {type(parent).__name__} reshapes by n_head={n_head}, which a "
                                     f"column split would not lower (only QKVParallel does, for a fused h -> 3h)")
    elif o % t:
        out.unavailable["column"] = f"out_features={o} is not divisible by tp={t}"
    else:
        heads, why = _heads(node, parent, o, t)
        col = ColumnParallel(heads=heads) if why is None else None
        if why:
            out.unavailable["column"] = why
    _, why_row = _heads(node, parent, i, t)
    row_ok = i % t == 0 and why_row is None
    if not row_ok:
        out.unavailable["row"] = why_row or f"in_features={i} is not divisible by tp={t}"
    return col, row_ok


def _linear(graph: Graph, node: Node, parent: nn.Module | None, cm: CostModel) -> NodeOptions:
    mod = node.module
    assert mod is not None and linear_layout(mod) is not None
    t, (i, o) = cm.t, linear_dims(mod)
    tokens = math.prod(node.out_shape[:-1]) / cm.d
    pb, out_b = _param_bytes(graph, node, cm), _bytes(node.out_shape, cm)
    in_shape = (*node.out_shape[:-1], i)
    res = NodeOptions([_option("B", None, "B", "B", cm.gemm(tokens, o, i), 0.0, cm.grad_allreduce(pb),
                               STATE_COPIES * pb + out_b)])
    if t == 1:
        return res
    col, row_ok = _linear_splits(node, mod, parent, cm, res)
    split = cm.gemm(tokens, o / t, i)
    bias_b = (mod.bias.numel() * cm.itemsize) if mod.bias is not None else 0.0
    if col is not None:
        res.options.append(_option("column", col, "B", "Sf", split, cm.reduce_over_tp(in_shape),
                                   cm.grad_allreduce(pb / t), STATE_COPIES * pb / t + out_b / t))
    if row_ok:
        w = pb - bias_b
        res.options.append(_option("row", RowParallel(), "Sf", "B", split, cm.reduce_over_tp(node.out_shape),
                                   cm.grad_allreduce(w / t + bias_b), STATE_COPIES * (w / t + bias_b) + out_b))
    if not isinstance(mod, nn.Linear):
        res.unavailable["vocab"] = "VocabParallel applies to an nn.Linear head (not a transposed layer)"
    elif not node.sink or node.succs:
        res.unavailable["vocab"] = "a vocabulary-parallel Linear must produce the model's output (the logits)"
    elif o < t:
        res.unavailable["vocab"] = f"out_features={o} is smaller than tp={t}"
    else:
        loss = 2 * cm.reduce_over_tp((*node.out_shape[:-1],))
        res.options.append(_option("vocab", VocabParallel(), "B", "Sf", split,
                                   cm.reduce_over_tp(in_shape) + loss, cm.grad_allreduce(pb / t),
                                   STATE_COPIES * pb / t + out_b / t))
    return res


def _embedding(graph: Graph, node: Node, cm: CostModel) -> NodeOptions:
    mod = node.module
    assert isinstance(mod, nn.Embedding)
    pb, out_b = _param_bytes(graph, node, cm), _bytes(node.out_shape, cm)
    res = NodeOptions([_option("B", None, "any", "B", cm.elementwise(out_b), 0.0, cm.grad_allreduce(pb),
                               STATE_COPIES * pb + out_b)])
    if cm.t == 1:
        return res
    if mod.num_embeddings < cm.t or mod.max_norm is not None or mod.sparse:
        res.unavailable["vocab"] = (f"num_embeddings={mod.num_embeddings} < tp={cm.t}, or max_norm/sparse set "
                                    f"(VocabParallel needs a plain table with at least one row per rank)")
        return res
    res.options.append(_option("vocab", VocabParallel(), "any", "B", cm.elementwise(out_b),
                               cm.reduce_over_tp(node.out_shape), cm.grad_allreduce(pb / cm.t),
                               STATE_COPIES * pb / cm.t + out_b))
    return res


def _experts(graph: Graph, node: Node, cm: CostModel) -> NodeOptions:
    """An MoE's experts module: replicated (every rank runs every expert), or ``ExpertParallel`` (each rank its
    ``E / tp`` experts on the same tokens: compute and weights / tp, an all-reduce of the output forward and of
    the input gradient backward). Rows: the output's (our experts: one per assignment), times ``top_k`` for
    transformers' (one per token; ``config.num_experts_per_tok``, else 1)."""
    mod = node.module
    assert mod is not None
    n, two_f, h = mod.gate_up_proj.shape
    k = getattr(getattr(mod, "config", None), "num_experts_per_tok", 1) if hasattr(mod, "act_fn") else 1
    rows = math.prod(node.out_shape[:-1]) * (k if isinstance(k, int) else 1) / cm.d
    compute = cm.gemm(rows, two_f, h) + cm.gemm(rows, h, two_f // 2)
    pb, out_b = _param_bytes(graph, node, cm), _bytes(node.out_shape, cm)
    res = NodeOptions([_option("B", None, "B", "B", compute, 0.0, cm.grad_allreduce(pb), STATE_COPIES * pb + out_b)])
    if cm.t == 1:
        return res
    if n % cm.t:
        res.unavailable["experts"] = f"its {n} experts do not divide over tp={cm.t}"
        return res
    comm = 2 * cm.reduce_over_tp(node.out_shape)
    res.options.append(_option("experts", ExpertParallel(), "B", "B", compute / cm.t, comm,
                               cm.grad_allreduce(pb / cm.t), STATE_COPIES * pb / cm.t + out_b))
    return res


def node_options(graph: Graph, node: Node, parents: dict[str, nn.Module], cm: CostModel) -> NodeOptions:
    """Every layout ``node`` may take under ``cm`` (the tp axis and its size), priced."""
    return _input_rule(node, _sink_rule(node, _node_options(graph, node, parents, cm)))


def _node_options(graph: Graph, node: Node, parents: dict[str, nn.Module], cm: CostModel) -> NodeOptions:
    out_b = _bytes(node.out_shape, cm)
    if node.kind == "join":
        opts = [_option("B", None, "B", "B", cm.elementwise(out_b), 0.0, 0.0, out_b)]
        if cm.t > 1:
            opts.append(_option("Sf", None, "Sf", "Sf", cm.elementwise(out_b / cm.t), 0.0, 0.0, out_b / cm.t))
        return NodeOptions(opts)
    if node.module is not None and linear_layout(node.module) is not None:
        return _linear(graph, node, parents.get(node.name), cm)
    if isinstance(node.module, nn.Embedding):
        return _embedding(graph, node, cm)
    if node.module is not None and expert_kind(node.module, parents.get(node.name)) is not None:
        return _experts(graph, node, cm)
    pb = _param_bytes(graph, node, cm)
    res = NodeOptions([_option("B", None, "B", "B", cm.elementwise(out_b), 0.0, cm.grad_allreduce(pb),
                               STATE_COPIES * pb + out_b)])
    return res


def applicable(node: Node) -> tuple[str, ...]:
    """The kinds that exist for this node's module type (the others are not alternatives at all)."""
    module = node.module
    if module is not None and linear_layout(module) is not None:
        return KINDS if node.sink and isinstance(module, nn.Linear) else KINDS[:3]
    if isinstance(module, nn.Embedding):
        return ("B", "vocab")
    return ("B", "experts") if module is not None and _is_experts(module) else ("B",)


def _is_experts(module: nn.Module) -> bool:
    """3-D expert weights (``expert_kind`` without the parent: ours are recognised through it when priced)."""
    weights = [getattr(module, w, None) for w in ("gate_up_proj", "down_proj")]
    return all(getattr(w, "dim", lambda: 0)() == 3 for w in weights)


def _input_rule(node: Node, res: NodeOptions) -> NodeOptions:
    """A unit fed by no traced node reads the model's own input (or values made from it), which every rank holds
    whole: nothing splits it on tp first, so an option that needs its input split (row) cannot run there —
    the solver's ``need``/``gives`` check has no predecessor to refuse it with."""
    if node.preds or node.kind != "module":
        return res
    for o in res.options:
        if o.need == "Sf":
            res.unavailable[o.kind] = ("its input is the model's own input, whole on every rank: no column-parallel "
                                       "layer splits it first")
    res.options = [o for o in res.options if o.need != "Sf"]
    return res


def _sink_rule(node: Node, res: NodeOptions) -> NodeOptions:
    """A value that leaves the model must be whole, except vocabulary-split logits (their loss is split)."""
    if not node.sink:
        return res
    for o in res.options:
        if o.gives == "Sf" and o.kind != "vocab":
            res.unavailable[o.kind] = "its output leaves the model and would stay split (only vocab logits may)"
    res.options = [o for o in res.options if o.gives != "Sf" or o.kind == "vocab"]
    return res
