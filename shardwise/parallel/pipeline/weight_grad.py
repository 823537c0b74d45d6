"""Split backward for zero-bubble schedules: B computes the input gradient, W the weight gradients later.

``WeightCapture`` records, during a stage's forward, the input ``x`` and output ``y`` of every module that owns
parameters directly; B asks autograd for dL/dy alongside dL/dx (no weight-gradient kernels run); W
(``weight_gradients``) then computes each module's weight gradient from ``x`` and dL/dy:

* ``nn.Linear``, ``nn.LayerNorm`` and a plain ``nn.Embedding`` by their closed forms (one matmul, one
  reduction, one ``index_add_``) — the same kernels autograd would run, without one autograd-engine call per
  module per micro-batch, whose fixed cost dominates small CPU matmuls (see ``shardwise bench pp``);
* any other module by its local backward ``grad(y, own params, dL/dy)``. Parameters of a tensor-parallel
  gradient region (sequence parallelism: the replicated norms, row biases and position embedding, which carry
  ``_shardwise_partial_axis``) always go this way: the local backward runs through the region's own autograd
  node, which sums them over tp (one all-reduce per such module in W, where a whole backward has one per
  region); a closed form would leave the partial, unsummed gradient. So does a module with forward hooks of
  its own (a hook may change its output, e.g. sequence parallelism keeps a slice of the position embedding's).

Under bf16 autocast a Linear's output ``y`` (so dL/dy) is bf16 while its input and weight are fp32: autocast ran
the matmul on bf16 casts, so W does too (``x`` cast to dL/dy's dtype, the product cast to the weight's dtype on
accumulation — what autograd's cast backward does); a LayerNorm whose input dtype differs from its weight's uses
the local autograd backward instead.

A module that returns several tensors (an MoE router: scores, expert ids, weights) is captured by its first
output that requires grad, when every other output reaches the module's parameters only through that one (the
router's weights are a gather of its scores): dL/dy of that output, asked for in B, is then the total over all
of them, so W's local backward is exact; the walk over the autograd graph that checks it is bounded. Any other
several-output module falls back as below.

When the capture is not exact (a parameter used twice in the stage, a module that owns parameters but whose
forward did not run, e.g. a Linear whose weight a parent applies functionally) W differentiates the whole
stage output again instead. A stage with activation checkpointing keeps no inputs (that would undo the
checkpointing): its W uses the local autograd backward, which recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import Tensor, nn

__all__ = ["Captured", "WeightCapture", "weight_gradients"]


@dataclass(frozen=True)
class Captured:
    """One weight-owning module's forward, as W needs it: the module and its first input (or ``None``)."""

    module: nn.Module
    input: Tensor | None
    version: int
    """``input._version`` at capture time: if the input is changed in place later, W uses autograd instead."""
    hooked: bool = False
    """The module has forward hooks besides the capture's: W uses autograd (the hooks may change its output)."""


class WeightCapture:
    """Forward hooks on a stage's modules that own parameters directly (Linear, LayerNorm, Embedding...):
    during a split-backward forward they record each such module's input and output ``y``.

    ``run`` returns ``(Captured, y)`` pairs; B asks autograd for dL/dy alongside dL/dx and W computes the
    weight gradients from them. That is exact when every trainable parameter belongs to one module that is
    called exactly once per forward; otherwise ``run`` returns ``None`` and the step falls back to
    differentiating the whole stage in W (always for a stage holding a compiled region). The hooks stay on the
    user's modules but record nothing outside a pipeline forward.
    """

    def __init__(self, stage: nn.Module) -> None:
        # Inside a compiled region (``sw.compile``) a module's output is internal to the compiled graph: dL/dy
        # cannot be asked for, so no capture there and W differentiates the whole stage (``exact`` False).
        compiled = {id(m) for r in stage.modules() if getattr(r, "_shardwise_compiled_region", False)
                    for m in r.modules()}
        self.modules = [m for m in stage.modules()
                        if next(m.parameters(recurse=False), None) is not None and id(m) not in compiled]
        # hooks the module had before ours: any of them may change the output the closed forms assume
        self.foreign_hooks = {id(m) for m in self.modules if m._forward_hooks}
        owners = [id(q) for m in self.modules for q in m.parameters(recurse=False)]
        self.exact = len(owners) == len(set(owners)) and not compiled
        self.active: list[tuple[nn.Module, Any, Any]] | None = None
        for m in self.modules:
            m.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.active is not None:
            x = args[0] if args and isinstance(args[0], Tensor) else None
            self.active.append((module, x, output))

    def run(self, stage: nn.Module, *inputs: Any) -> tuple[Any, list[tuple[Captured, Tensor]] | None]:
        """``stage(*inputs)`` and the captured (record, output) pairs, or ``None`` when W must use the fallback."""
        self.active = []
        try:
            out = stage(*inputs)
        finally:
            got, self.active = self.active, None
        trainable = [m for m in self.modules if any(q.requires_grad for q in m.parameters(recurse=False))]
        got = [g for g in got if any(q.requires_grad for q in g[0].parameters(recurse=False))]  # not frozen
        fired = {id(m) for m, _, _ in got}
        got = [(m, xi, _single_output(y, m, xi)) for m, xi, y in got]  # several outputs: the one W differentiates
        ok = (self.exact and len(fired) == len(got) and fired == {id(m) for m in trainable}
              and all(isinstance(y, Tensor) and y.requires_grad for _, _, y in got))
        if not ok:
            return out, None
        if getattr(stage, "checkpoint", False):  # keeping inputs would undo activation checkpointing: use autograd
            got = [(m, None, y) for m, _, y in got]
        return out, [(Captured(m, xi, xi._version if xi is not None else 0, id(m) in self.foreign_hooks), y)
                     for m, xi, y in got]


def _single_output(y: Any, module: nn.Module, x: Tensor | None, limit: int = 256) -> Any:
    """``y`` itself for a tensor output; for several outputs (nested too) the first that requires grad when the
    others reach ``module``'s own parameters only through it (module docstring), else ``None`` (W falls back)."""
    if isinstance(y, Tensor) or not isinstance(y, (tuple, list, dict)):
        return y
    outs = [t for t in pytree.tree_leaves(y) if isinstance(t, Tensor) and t.requires_grad]
    if not outs or outs[0].grad_fn is None:
        return None
    own = {id(q) for q in module.parameters(recurse=False)}
    # an output is (autograd node, output index): two outputs of one node (an RNN's) are different tensors
    stop = {(id(outs[0].grad_fn), outs[0].output_nr)}
    if x is not None and x.grad_fn is not None:
        stop.add((id(x.grad_fn), x.output_nr))
    stack, seen = [(t.grad_fn, t.output_nr) for t in outs[1:]], set()
    while stack:  # every node between the other outputs and the first (or the module's input)
        node, nr = stack.pop()
        if node is None or (id(node), nr) in stop or id(node) in seen:
            continue
        seen.add(id(node))
        var = getattr(node, "variable", None)  # AccumulateGrad: a parameter reached around the first output
        if len(seen) > limit or (var is not None and id(var) in own):
            return None
        stack.extend(node.next_functions)
    return outs[0]


# -- closed-form weight gradients: (module, input x, dL/dy) -> [(parameter, its gradient contribution)] ----------
def _linear(m: nn.Module, x: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
    # y = x W^T + b: x (..., in), g (..., out) -> dW = g^T x (out, in), db = sum of g over rows (out,).
    # Autocast: g is bf16, the forward multiplied bf16(x): the same kernel here, cast up in _accumulate.
    g2, x2 = g.reshape(-1, g.size(-1)), x.reshape(-1, x.size(-1)).to(g.dtype)
    w = m.weight
    if w.requires_grad and w.grad is not None and w.grad.is_contiguous() and w.grad.dtype == g2.dtype:
        w.grad.addmm_(g2.t(), x2)  # later micro-batches: accumulate in the matmul, no temporary (out, in)
        out = []
    else:
        out = [(w, g2.t() @ x2)]
    if m.bias is not None:
        out.append((m.bias, g2.sum(0)))
    return out


def _layer_norm(m: nn.Module, x: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
    # y = xhat * w + b over the trailing normalized_shape: dw = sum(g * xhat), db = sum(g) over leading dims
    shape = tuple(m.normalized_shape)
    xhat = F.layer_norm(x, shape, None, None, m.eps)
    out = [(m.weight, (g * xhat).reshape(-1, *shape).sum(0))]
    if m.bias is not None:
        out.append((m.bias, g.reshape(-1, *shape).sum(0)))
    return out


def _embedding(m: nn.Module, idx: Tensor, g: Tensor) -> list[tuple[Tensor, Tensor]]:
    # y = W[idx]: idx (...), g (..., dim) -> dW rows idx accumulate g (rows not looked up get zero)
    dw = torch.zeros_like(m.weight).index_add_(0, idx.reshape(-1), g.reshape(-1, g.size(-1)).to(m.weight.dtype))
    return [(m.weight, dw)]


def _rule(m: nn.Module, x: Tensor | None) -> Callable[..., list[tuple[Tensor, Tensor]]] | None:
    """The closed form for ``m`` when it applies exactly (plain modules only: subclasses may change forward;
    never for parameters whose gradient autograd sums over a tensor-parallel axis)."""
    if x is None or any(hasattr(q, "_shardwise_partial_axis") for q in m.parameters(recurse=False)):
        return None
    if type(m) is nn.Linear and x.is_floating_point():
        return _linear
    if type(m) is nn.LayerNorm and m.elementwise_affine and x.dtype == m.weight.dtype:
        return _layer_norm
    if (type(m) is nn.Embedding and m.padding_idx is None and m.max_norm is None and not m.scale_grad_by_freq
            and not m.sparse and not x.is_floating_point()):
        return _embedding
    return None


def _accumulate(q: Tensor, gq: Tensor) -> None:
    gq = gq.to(q.dtype)  # autocast: a bf16 weight gradient lands in the fp32 parameter's .grad, as autograd's would
    q.grad = gq if q.grad is None else q.grad.add_(gq)


def weight_gradients(stage: nn.Module, out: Tensor | list[Tensor], grad: Any,
                     enter: Callable[[nn.Module | None], None] | None = None) -> None:
    """W for one (stage, micro-batch): ``grad`` is the list of ((record, y), dL/dy) pairs B left, or, when the
    capture fell back, the gradients of the stage outputs ``out`` (a tuple, or ``None`` for the loss), which are
    then differentiated again. Accumulates ``.grad``. ``enter(module)`` (ZeRO-3): called before a module's parameter
    values are read (``None``: every module of the stage); the closed forms of Linear and LayerNorm read none."""
    if not isinstance(grad, list):  # fallback: differentiate the whole stage again (see WeightCapture)
        if enter is not None:
            enter(None)
        params = [q for q in stage.parameters() if q.requires_grad]
        for q, gq in zip(params, torch.autograd.grad(out, params, grad, retain_graph=True, allow_unused=True)):
            if gq is not None:
                _accumulate(q, gq)
        return
    for (rec, y), g in grad:
        if g is None:  # the output did not reach the loss: no gradient, as on one device
            continue
        mod, x = rec.module, rec.input
        ok = not rec.hooked and (x is None or x._version == rec.version)
        rule = _rule(mod, x) if ok else None
        if enter is not None and rule not in (_linear, _layer_norm):
            enter(mod)
        if rule is not None:
            with torch.no_grad():
                for q, gq in rule(mod, x, g):
                    if q.requires_grad:
                        _accumulate(q, gq)
            continue
        # the module's local backward only (its outputs feed later captured modules: one call for several
        # would count their contributions twice)
        params = [q for q in mod.parameters(recurse=False) if q.requires_grad]
        for q, gq in zip(params, torch.autograd.grad(y, params, g, retain_graph=True, allow_unused=True)):
            if gq is not None:
                _accumulate(q, gq)
