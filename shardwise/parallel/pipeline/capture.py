"""Capture a model's forward as a graph of module calls and torch calls, by running it once.

Why not ``torch.fx.symbolic_trace`` or ``torch.export``: symbolic tracing cannot follow the Python of typical
third-party models (``transformers`` 5's decorators fail it outright; mask builders branch on tensor values),
and ``torch.export`` (which does capture them) inlines every module into ATen operators — the modules that
tensor parallelism, zero-bubble weight gradients and activation checkpointing hook into would be gone, and the
graph's reshapes would hard-code the full head counts that tensor parallelism shards. So we do what
``torch.export``'s non-strict mode does — run the model once on example inputs, Python control flow resolved by
that run — but intercept at the torch-function level (a ``TorchFunctionMode``), as fx does, and keep chosen
modules opaque: a call of such a **leaf** module is one node, run on replay by the original module object.

Values are followed by tensor identity, so Python containers in the model's code (tuples returned by a layer,
``ModelOutput`` dataclasses, dicts of kwargs) need no tracing. What the run specialises:

* shapes: ``x.shape[1]`` and anything computed from it are constants — replay needs the example's shapes
  (one micro-batch; ``Pipeline.step`` checks);
* non-tensor values (flags, ``None`` inputs, config fields): constants;
* a Python decision on a tensor *value* that depends on the inputs (``if mask.all():``, ``int(x.sum())``,
  ``.item()``, ``.tolist()``) cannot be baked in: ``CaptureError`` names the construct and the source line;
* an object made inside the forward and passed on (a Hugging Face ``DynamicCache``) is state of one call, not
  a constant: every replay makes its own (``made.py``). One holding tensors computed in the forward, which the
  graph cannot follow into an object, or one that cannot be copied, is refused: ``CaptureError`` names its type
  and the line that made it.

The graph is plain data (``Graph.describe()`` prints it). Capture restores the RNG state and every buffer
afterwards, so it changes neither the model nor the random stream.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import linecache
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .made import Made, Remake, model_frames, reachable, where_made

__all__ = ["CaptureError", "Node", "Graph", "Ref", "Made", "Remake", "capture", "refs_in", "walk"]

# torch functions whose result turns a tensor's *value* into Python (a branch, a loop bound, a size). Tensor-valued
# reductions (``x.any(dim=1)``, ``nonzero``) replay fine, and ``len(x)`` / iteration depend on the shape only.
_VALUE_READS = {Tensor.__bool__, Tensor.item, Tensor.tolist, Tensor.__int__, Tensor.__float__, Tensor.__index__}


class CaptureError(ValueError):
    """The model's forward cannot be captured as one graph (the message says which construct and where)."""


@dataclass
class Node:
    """One step of the captured forward.

    ``op``: ``input`` (a tensor of the call's arguments, ``target`` its pytree position), ``attr`` (a parameter
    or buffer read by glue code, ``target`` its qualified name), ``const`` (a tensor made outside torch calls,
    ``target`` the tensor), ``call`` (``target(*args, **kwargs)`` a torch function or tensor method), ``module``
    (``target`` the leaf module's qualified name), ``pick`` (the ``target``-th tensor leaf of node ``args[0]``'s
    result). ``args``/``kwargs`` hold ``Ref``s where a tensor of another node flowed in."""

    index: int
    op: str
    target: Any
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    requires_grad: bool = False
    meta: tuple[torch.dtype, tuple[int, ...]] | None = None
    """dtype and shape for tensor-valued nodes (input, attr, const, pick)."""

    def label(self) -> str:
        if self.op == "const":
            return "const"
        name = getattr(self.target, "__qualname__", None) or getattr(self.target, "__name__", None)
        return f"{self.op}:{name or self.target}"


@dataclass(frozen=True)
class Ref:
    """A reference to node ``index``'s value inside another node's arguments."""

    index: int


@dataclass
class Graph:
    """The captured forward: ``nodes`` in execution order, the output's pytree spec and its leaves."""

    nodes: list[Node]
    output_spec: pytree.TreeSpec
    output: list[Any]
    """The output's leaves: ``Ref`` for tensors, the value itself otherwise."""
    input_spec: pytree.TreeSpec
    leaf_order: list[str]
    """Leaf modules in the order of their first call (a pipeline cut falls before one of them)."""
    made: list[Remake] = field(default_factory=list)
    """Objects made inside the forward (``Made`` markers point here), made anew on every replay."""

    def describe(self) -> str:
        lines = []
        for n in self.nodes:
            shape = f" {str(n.meta[0]).replace('torch.', '')}{list(n.meta[1])}" if n.meta else ""
            deps = sorted({r.index for r in refs_in((n.args, n.kwargs))})
            lines.append(f"%{n.index:<4} {n.label():<48}{shape}  <- {', '.join(f'%{d}' for d in deps) or '-'}")
        lines += [f"made per call #{k}: {m.kind} (made at {m.where})" for k, m in enumerate(self.made)]
        return "\n".join(lines)


def walk(obj: Any, leaf: Callable[[Any], Any]) -> Any:
    """``obj`` rebuilt with ``leaf`` applied to everything that is not a tuple, list, dict or slice (the
    containers a call's arguments are made of; named tuples are leaves)."""
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(walk(x, leaf) for x in obj)
    if isinstance(obj, list):
        return [walk(x, leaf) for x in obj]
    if isinstance(obj, dict):
        return {k: walk(v, leaf) for k, v in obj.items()}
    if isinstance(obj, slice):
        return slice(walk(obj.start, leaf), walk(obj.stop, leaf), walk(obj.step, leaf))
    return leaf(obj)


def refs_in(obj: Any) -> Iterator[Ref]:
    """Every ``Ref`` inside nested tuples/lists/dicts/slices."""
    if isinstance(obj, Ref):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from refs_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from refs_in(x)
    elif isinstance(obj, slice):
        yield from refs_in((obj.start, obj.stop, obj.step))


class _Recorder(TorchFunctionMode):
    """Records torch calls made outside leaf modules; leaf modules' hooks record their calls as one node."""

    def __init__(self, model: nn.Module, leaves: dict[str, nn.Module]) -> None:
        super().__init__()
        self.nodes: list[Node] = []
        self.of: dict[int, int] = {}  # id(tensor) -> node index holding it
        self.keep: list[Tensor] = []  # keeps every seen tensor alive, so ids are never reused
        self.tainted: set[int] = set()  # node indices whose value depends on the inputs
        self.depth = 0
        self.busy = False
        self.attrs = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
        self.leaf_names = {id(m): n for n, m in leaves.items()}
        self.leaf_order: list[str] = []
        self.before: set[int] = set()  # ids of the objects that existed before the forward (kept alive meanwhile)
        self.made: list[Remake] = []
        self.made_of: dict[int, int] = {}  # id(object made inside the forward) -> index in ``made``

    # -- values --------------------------------------------------------------------------------------
    def add(self, op: str, target: Any, args: tuple = (), kwargs: dict | None = None, value: Any = None,
            taint: bool = False) -> int:
        node = Node(len(self.nodes), op, target, args, kwargs or {})
        if isinstance(value, Tensor):
            node.meta, node.requires_grad = (value.dtype, tuple(value.shape)), value.requires_grad
            self.of[id(value)] = node.index
            self.keep.append(value)
        self.nodes.append(node)
        if taint:
            self.tainted.add(node.index)
        return node.index

    def ref(self, obj: Any) -> Any:
        """``obj`` with every tensor replaced by a ``Ref`` to the node holding it (new attr/const nodes for
        tensors first seen here)."""
        return walk(obj, self._ref_leaf)

    def _ref_leaf(self, obj: Any) -> Any:
        if not isinstance(obj, Tensor):
            return self._made_leaf(obj)
        if id(obj) not in self.of:
            name = self.attrs.get(id(obj))
            self.add("attr", name, value=obj) if name else self.add("const", obj.detach().clone(), value=obj)
        return Ref(self.of[id(obj)])

    def _made_leaf(self, obj: Any) -> Any:
        """A ``Made`` marker for an object made inside the forward (first seen: copied as it is now), else ``obj``."""
        k = self.made_of.get(id(obj))
        if k is None:
            if id(obj) in self.before or not gc.is_tracked(obj) or callable(obj):
                return obj  # older than the forward, immutable, or a function, class or module
            self.made.append(self._remake(obj, where_made(obj)))
            k = self.made_of[id(obj)] = len(self.made) - 1
            self.keep.append(obj)
        return Made(k)

    def _remake(self, obj: Any, where: str) -> Remake:
        """``obj``'s copy and the older objects it shares; ``CaptureError`` if it holds tensors of the forward."""
        kind = type(obj).__qualname__
        shared, held = reachable(obj, self.before)
        computed = [list(t.shape) for t in held if t.requires_grad or self.of.get(id(t), -1) in self.tainted
                    or id(t) not in self.of]
        head = f"cannot capture the model's forward: a {kind} made inside the forward at {where}"
        fix = f"or switch off what makes the {kind} (a Hugging Face model's cache: use_cache=False)"
        if computed:
            raise CaptureError(f"{head} holds tensors computed in the forward (shapes {computed[:4]}), which the "
                               f"graph cannot follow into an object, so it cannot be made anew for every call; pass "
                               f"them to the modules themselves (tuples, lists and dicts are followed), {fix}")
        try:
            return Remake(kind, where, copy.deepcopy(obj, dict(shared)), shared)
        except Exception as exc:  # noqa: BLE001 - whatever the object's own copying raises
            raise CaptureError(f"{head} must be made anew for every call, but copy.deepcopy fails "
                               f"({' '.join(f'{type(exc).__name__}: {exc}'.split())}); give {kind} a working "
                               f"__deepcopy__, {fix}") from exc

    def result(self, index: int, out: Any) -> None:
        """Register the tensors of node ``index``'s result as ``pick`` nodes (by pytree leaf position)."""
        leaves, _ = pytree.tree_flatten(out)
        taint = index in self.tainted
        for k, leaf in enumerate(leaves):
            if isinstance(leaf, Tensor):
                self.add("pick", k, (Ref(index),), value=leaf, taint=taint)

    # -- interception ----------------------------------------------------------------------------------
    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.depth or self.busy:
            return out
        self.busy = True  # our own bookkeeping (x.dtype, x.shape) calls torch functions too
        try:
            if func in _VALUE_READS and any(self.of.get(id(t)) in self.tainted for t in _tensors((args, kwargs))):
                raise CaptureError(_value_read_message(func))
            if _keeps(func, out):
                a, k = self.ref(args), self.ref(kwargs)
                taint = any(r.index in self.tainted for r in refs_in((a, k)))
                self.result(self.add("call", func, a, k, taint=taint), out)
        finally:
            self.busy = False
        return out

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.depth == 0:
            self.busy = True
            self._pending = (self.ref(args), self.ref(kwargs))
            self.busy = False
        self.depth += 1

    def post_hook(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        self.depth -= 1
        if self.depth:
            return
        self.busy = True
        try:
            self._record_module(module, out)
        finally:
            self.busy = False

    def _record_module(self, module: nn.Module, out: Any) -> None:
        a, k = self._pending
        name = self.leaf_names[id(module)]
        if name not in self.leaf_order:
            self.leaf_order.append(name)
        taint = any(r.index in self.tainted for r in refs_in((a, k)))
        index = self.add("module", name, a, k, taint=taint)
        self.result(index, out)


class _Box:
    """A dataclass instance that pytree does not know (``transformers``' outputs are registered, a user's
    ``@dataclass`` output is not): flattened by field, rebuilt as the original class."""

    def __init__(self, cls: type, fields: dict[str, Any]) -> None:
        self.cls, self.fields = cls, fields


def _unbox(values: list[Any], context: tuple[type, list[str]]) -> Any:
    cls, names = context
    obj = cls.__new__(cls)
    for name, v in zip(names, values):
        object.__setattr__(obj, name, v)
    return obj


pytree.register_pytree_node(_Box, lambda b: (list(b.fields.values()), (b.cls, list(b.fields))), _unbox)


def _box(obj: Any) -> Any:
    """``obj`` with every dataclass that pytree cannot flatten replaced by a ``_Box`` (recursively)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and type(obj) not in pytree.SUPPORTED_NODES:
        return _Box(type(obj), {f.name: _box(getattr(obj, f.name)) for f in dataclasses.fields(obj)})
    if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
        return type(obj)(_box(x) for x in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _box(v) for k, v in obj.items()}
    return obj


def _tensors(obj: Any) -> list[Tensor]:
    return [x for x in pytree.tree_flatten(obj)[0] if isinstance(x, Tensor)]


def _keeps(func: Callable, out: Any) -> bool:
    """Whether a call is part of the computation: it returns a tensor, or may change one in place
    (``x[i] = v``, ``x.copy_(y)``). Reads of shapes, dtypes and flags (``x.shape``, ``x.size(1)``) are constants
    in the graph, and hook registrations (``register_hook``, made by profilers and tools) are not the model's."""
    if any(isinstance(x, Tensor) for x in pytree.tree_flatten(out)[0]):
        return True
    name = getattr(func, "__name__", "")
    return name == "__setitem__" or (name.endswith("_") and not name.startswith("_") and "hook" not in name)


def _value_read_message(func: Callable) -> str:
    f = next(model_frames(), None)
    where = f"{f.f_code.co_filename}:{f.f_lineno} ({linecache.getline(f.f_code.co_filename, f.f_lineno).strip()})" \
        if f else "the model's forward"
    name = getattr(func, "__name__", str(func))
    return (f"cannot capture the model's forward: data-dependent control flow — {name}() reads the value of a "
            f"tensor computed from the inputs at {where}, so one run cannot stand for every input; pass a model "
            f"without that branch (e.g. no attention_mask), or let the pipeline cut an nn.Sequential or a model "
            f"with a 'blocks' ModuleList (split= by their names) instead")


def capture(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], leaves: dict[str, nn.Module]) -> Graph:
    """Run ``model(*args, **kwargs)`` once and return its graph; ``leaves`` (name -> module) stay opaque."""
    rec = _Recorder(model, leaves)
    flat, in_spec = pytree.tree_flatten((tuple(args), dict(kwargs)))
    # one tensor passed twice (labels=input_ids) must still be two inputs: later steps may pass two tensors
    seen: set[int] = set()
    flat = [x.clone() if isinstance(x, Tensor) and (id(x) in seen or seen.add(id(x))) else x for x in flat]
    args, kwargs = pytree.tree_unflatten(flat, in_spec)
    for k, x in enumerate(flat):
        if isinstance(x, Tensor):
            rec.add("input", k, value=x, taint=True)
    handles = [h for m in leaves.values() for h in (
        m.register_forward_pre_hook(rec.pre_hook, with_kwargs=True, prepend=True),
        m.register_forward_hook(rec.post_hook, with_kwargs=True, always_call=True))]
    saved = {n: b.detach().clone() for n, b in model.named_buffers()}
    alive = gc.get_objects()  # what exists before the forward (held, so no later object can reuse an id)
    rec.before = {id(x) for x in alive}
    try:
        with torch.random.fork_rng(devices=[]), rec:
            out = model(*args, **kwargs)
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the user's forward under capture
        raise CaptureError(f"cannot capture the model's forward on the example inputs: {type(exc).__name__}: "
                           f"{exc}; check example_inputs (one micro-batch, as the model's forward takes it), or cut "
                           f"an nn.Sequential / a model with a 'blocks' ModuleList instead") from exc
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, b in model.named_buffers():
                if n in saved:
                    b.copy_(saved[n])
    leaves_out, out_spec = pytree.tree_flatten(_box(out))
    output = [rec.ref(x) for x in leaves_out]
    return Graph(rec.nodes, out_spec, output, in_spec, rec.leaf_order, rec.made)
