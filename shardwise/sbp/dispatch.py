"""Running torch ops on global tensors: pick an SBP signature per mesh axis, box inputs, run locally, wrap.

Why ``__torch_function__`` on a plain wrapper (not ``__torch_dispatch__`` on a tensor subclass): it sees the
op the user called (``F.linear``, ``F.softmax``) before autograd decomposes it, so one rule covers forward
*and* backward (backward runs on local tensors through ordinary autograd plus the boxing steps' conjugates),
and the decision for a given (op, input specs, arguments) is computed once and cached (a bounded LRU) — a
repeated op costs a dict lookup on top of the local kernel. The price: only ops with a rule work on global
tensors; anything else raises an error that names the op and the inputs' SBPs and suggests ``to_sbp()`` or
``to_local()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..comm.autograd import identity_allreduce
from .boxing import route_boxing
from .lru import LRU
from .placement import Replicate, Partial, Placement, Split, format_sbp
from .rules import Candidate, rule_for
from .spec import TensorSpec

__all__ = ["dispatch", "OP_NAMES"]

# func -> (rule name, names of its leading positional parameters)
OP_NAMES: dict[Callable[..., Any], tuple[str, tuple[str, ...]]] = {
    torch.add: ("add", ("input", "other")), torch.sub: ("sub", ("input", "other")),
    torch.mul: ("mul", ("input", "other")), torch.div: ("div", ("input", "other")),
    torch.neg: ("neg", ("input",)), torch.matmul: ("matmul", ("input", "other")),
    F.linear: ("linear", ("input", "weight", "bias")), F.gelu: ("gelu", ("input",)),
    F.relu: ("relu", ("input",)), torch.relu: ("relu", ("input",)), F.silu: ("silu", ("input",)),
    torch.tanh: ("tanh", ("input",)), torch.exp: ("exp", ("input",)),
    F.softmax: ("softmax", ("input", "dim")), torch.softmax: ("softmax", ("input", "dim")),
    F.log_softmax: ("log_softmax", ("input", "dim")), torch.log_softmax: ("log_softmax", ("input", "dim")),
    F.layer_norm: ("layer_norm", ("input", "normalized_shape")), F.embedding: ("embedding", ("input", "weight")),
    F.cross_entropy: ("cross_entropy", ("input", "target")), F.dropout: ("dropout", ("input", "p")),
    torch.sum: ("sum", ("input", "dim", "keepdim")), torch.mean: ("mean", ("input", "dim", "keepdim")),
    torch.permute: ("permute", ("input", "dims")), torch.transpose: ("permute", ("input", "dim0", "dim1")),
    torch.reshape: ("reshape", ("input", "shape")),
}
if hasattr(F, "rms_norm"):
    OP_NAMES[F.rms_norm] = ("rms_norm", ("input", "normalized_shape"))


@dataclass(frozen=True)
class _Decision:
    inputs: tuple[tuple[Placement, ...], ...]
    """Target SBP of every tensor input."""
    out: TensorSpec
    local_shape: tuple[int, ...]
    post: str
    """'' or 'divide' (a mean computed as a local sum divided by the global count)."""
    divisor: int
    grad_axes: tuple[tuple[str, ...], ...]
    """Per input: axes where it is B but the output is not — each rank's local backward then yields only a
    partial gradient, so the input passes through identity-forward / all-reduce-backward on those axes to
    keep the convention that a B tensor's gradient is whole on every rank (Megatron's "f" operator)."""


_CACHE_SIZE = 4096
"""Entries of each decision cache. One GPT training step meets well under a hundred distinct (op, specs,
arguments) keys, so a steady loop never evicts; the bound only matters for a process that keeps meeting new
shapes, where it caps the caches at a few MB (a decision is a few hundred bytes)."""

_CACHE: LRU[Any, _Decision] = LRU(_CACHE_SIZE)
"""Decisions by (op, input specs, normalised parameters): the slow path's key."""


def _params(names: tuple[str, ...], args: tuple, kwargs: dict) -> dict[str, Any]:
    p = dict(zip(names, args))
    p.update({k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor) and not _is_global(v)})
    return p


def _is_global(x: Any) -> bool:
    return hasattr(x, "spec") and hasattr(x, "to_local") and hasattr(x, "mesh")


def _rule_params(name: str, params: dict[str, Any], shapes: list[tuple[int, ...]], scalar: bool) -> dict[str, Any]:
    kw = dict(params)
    kw["scalar_operand"] = scalar
    nd = len(shapes[0])
    if name == "permute" and "dim0" in params:
        perm = list(range(nd))
        a, b = params["dim0"] % nd, params["dim1"] % nd
        perm[a], perm[b] = perm[b], perm[a]
        kw["perm"] = tuple(perm)
    elif name == "permute":
        kw["perm"] = tuple(d % nd for d in params["dims"])
    if name == "reshape":
        shape = list(params["shape"])
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape[shape.index(-1)] = math.prod(shapes[0]) // max(known, 1)
        kw["shape"] = tuple(shape)
    if name in ("softmax", "log_softmax") and kw.get("dim") is None:
        raise ValueError(f"{name} on a global tensor needs an explicit dim")
    return kw


def _convert_cost(p: Placement, q: Placement, spec: TensorSpec, axis: int, itemsize: int) -> float:
    if p == q:
        return 0.0
    local = list(spec.local_shape((0,) * len(spec.mesh_shape)))
    plan = route_boxing(tuple(local), itemsize, (p,), (q,), (spec.mesh_shape[axis],), ("x",))
    return plan.bytes_sent + 1.0 * len(plan.steps)


def _choose(cands: list[Candidate], specs: list[TensorSpec], axis: int) -> Candidate:
    def cost(c: Candidate) -> float:
        return sum(_convert_cost(s.sbp[axis], c[i], s, axis, s.dtype.itemsize if hasattr(s.dtype, "itemsize")
                                 else 4) for i, s in enumerate(specs))
    return min(cands, key=cost)


def _decide(name: str, func: Callable[..., Any], specs: list[TensorSpec], params: dict[str, Any],
            meta_call: Callable[[], torch.Tensor], coords: tuple[int, ...], scalar: bool) -> _Decision:
    rule = rule_for(name)
    assert rule is not None
    shapes = [s.shape for s in specs]
    kw = _rule_params(name, params, shapes, scalar)
    n_axes = len(specs[0].mesh_shape)
    chosen = [_choose(rule(shapes, kw), specs, a) for a in range(n_axes)]
    inputs = tuple(tuple(c[i] for c in chosen) for i in range(len(specs)))
    out_sbp = tuple(c[-1] for c in chosen)
    meta = meta_call()
    out = TensorSpec(tuple(meta.shape), meta.dtype, out_sbp, specs[0].axes, specs[0].mesh_shape)
    post, divisor = "", 1
    if name in ("mean", "cross_entropy"):
        # Split reduced dim -> P: each rank sums its rows; the mean divides by the *global* count.
        if any(isinstance(i, Split) and isinstance(o, Partial) for i, o in zip(inputs[0], out_sbp)):
            post = "divide"
            divisor = math.prod(specs[0].shape) // max(1, math.prod(meta.shape)) if name == "mean" else \
                (math.prod(specs[1].shape) if params.get("reduction", "mean") == "mean" else 1)
    grad_axes = tuple(tuple(specs[0].axes[a] for a in range(n_axes)
                            if isinstance(inp[a], Replicate) and not isinstance(out_sbp[a], Replicate))
                      for inp in inputs)
    return _Decision(inputs, out, out.local_shape(coords), post, divisor, grad_axes)


def _params_key(params: dict[str, Any]) -> Any:
    try:
        key = tuple(params.items())
        hash(key)
        return key
    except TypeError:  # lists and the like
        return repr(sorted((k, repr(v)) for k, v in params.items()))


def _boxed(x: Any, sbp: tuple[Placement, ...], grad_axes: tuple[str, ...]) -> torch.Tensor:
    local = x._local if x.spec.sbp == sbp else x.to_sbp(sbp).to_local()
    if grad_axes and local.requires_grad:
        for axis in grad_axes:
            local = identity_allreduce(local, x.mesh, axis)
    return local


def _fast_key(func: Callable[..., Any], args: tuple, kwargs: dict, gt: type) -> Any:
    """A cheap cache key when every tensor argument is a global tensor and the rest are hashable; else None."""
    parts: list[Any] = [func]
    for a in args:
        if type(a) is gt:
            parts.append(a.spec)
        elif isinstance(a, torch.Tensor):
            return None
        else:
            parts.append(a)
    if kwargs:
        for k, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                return None
            parts.append((k, v.spec if type(v) is gt else v))
    key = tuple(parts)
    try:
        hash(key)
    except TypeError:
        return None
    return key


_FAST: LRU[Any, tuple[_Decision, str]] = LRU(_CACHE_SIZE)
"""Decisions by the raw call (``_fast_key``): skips normalising the parameters on a repeated call."""


def dispatch(func: Callable[..., Any], args: tuple, kwargs: dict | None, gt: type) -> Any:
    """Run ``func`` on global tensors (see module docstring). Collective when inputs need boxing.

    ``gt`` is the global tensor class (``GlobalTensor.__torch_function__`` passes itself): injected rather than
    imported, so this module and ``global_tensor.py`` do not import each other."""
    GlobalTensor = gt
    kwargs = kwargs or {}
    fast = _fast_key(func, args, kwargs, GlobalTensor)
    hit = _FAST.get(fast) if fast is not None else None
    if hit is not None:
        decision, name = hit
        flat = list(args) + list(kwargs.values()) if kwargs else list(args)
        mesh = next(x for x in flat if type(x) is GlobalTensor).mesh
    else:
        decision, name, flat, mesh = _slow_decide(func, args, kwargs, GlobalTensor)
        if fast is not None:
            _FAST.put(fast, (decision, name))
    return _execute(func, name, decision, flat, len(args), list(kwargs), mesh, GlobalTensor)


def _slow_decide(func: Callable[..., Any], args: tuple, kwargs: dict, gt: type) -> tuple[_Decision, str, list, Any]:
    entry = OP_NAMES.get(func)
    flat = list(args) + list(kwargs.values())
    globals_ = [x for x in flat if isinstance(x, gt)]
    if entry is None:
        sbps = ", ".join(f"[{format_sbp(g.sbp)}]" for g in globals_)
        raise NotImplementedError(
            f"{getattr(func, '__name__', func)} has no SBP rule (inputs: {sbps}); convert first with "
            f"x.to_sbp(...) and work on x.to_local(), or use x.full() for the whole tensor")
    name, names = entry
    mesh = globals_[0].mesh
    for g in globals_[1:]:
        if g.mesh is not mesh:
            raise ValueError(f"{name}: inputs live on different meshes ({g.mesh} and {mesh}); move them to one "
                             f"mesh first")
    flat = [x if isinstance(x, gt) else _replicated(x, mesh, gt) if isinstance(x, torch.Tensor) else x
            for x in flat]
    tensors = [x for x in flat if isinstance(x, gt)]
    scalar = any(isinstance(x, (int, float)) and not isinstance(x, bool) for x in args[1:2])
    params = _params(names, args, kwargs)
    key = (func, tuple(t.spec for t in tensors), _params_key(params))
    decision = _CACHE.get(key)
    if decision is None:
        coords = tuple(mesh.coord(a) for a in mesh.axes)

        def meta_call() -> torch.Tensor:
            metas = [torch.empty(x.spec.shape, dtype=x.dtype, device="meta") if isinstance(x, gt) else x
                     for x in flat]
            return func(*metas[:len(args)], **dict(zip(kwargs, metas[len(args):])))
        decision = _decide(name, func, [t.spec for t in tensors], params, meta_call, coords, scalar)
        _CACHE.put(key, decision)
    return decision, name, flat, mesh


def _replicated(x: torch.Tensor, mesh: Any, gt: type) -> Any:
    """A plain tensor operand as a B global tensor (every rank holds it whole), as ``to_global(x, mesh, B...)``."""
    sbp = tuple(Replicate() for _ in mesh.axes)
    return gt(x, TensorSpec(tuple(x.shape), x.dtype, sbp, mesh.axes, mesh.shape), mesh)


def _execute(func: Callable[..., Any], name: str, decision: _Decision, flat: list, n_args: int,
             kw_names: list[str], mesh: Any, gt: type) -> Any:
    locals_ = []
    k = 0
    for x in flat:
        if type(x) is gt:
            x = _boxed(x, decision.inputs[k], decision.grad_axes[k])
            k += 1
        locals_.append(x)
    call_kwargs = dict(zip(kw_names, locals_[n_args:]))
    if decision.post == "divide" and name == "cross_entropy":
        call_kwargs["reduction"] = "sum"
    out = (torch.sum if name == "mean" and decision.post else func)(*locals_[:n_args], **call_kwargs)
    if decision.post == "divide":
        out = out / decision.divisor
    if out.shape != decision.local_shape:
        raise ValueError(f"{name} produced a local piece of shape {tuple(out.shape)} where {decision.out} expects "
                         f"{decision.local_shape} (uneven splits through this op are not supported); box the inputs "
                         f"to B first with x.to_sbp(...)")
    return gt(out, decision.out, mesh)
