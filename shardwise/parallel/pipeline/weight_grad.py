"""Split backward for zero-bubble schedules: B computes the input gradient, W the weight gradients later.

``WeightCapture`` records, during a stage's forward, the output ``y`` of every module that owns parameters
directly; B asks autograd for dL/dy alongside dL/dx (no weight-gradient kernels run); W
(``weight_gradients``) then runs each module's local backward ``grad(y, own params, dL/dy)`` and accumulates
into ``.grad``. When the capture is not exact (a parameter used twice in the stage) W differentiates the
whole stage output again instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["WeightCapture", "weight_gradients"]


class WeightCapture:
    """Forward hooks on a stage's modules that own parameters directly (Linear, LayerNorm, Embedding...):
    during a split-backward forward they record each such module's output ``y``.

    B then asks autograd for dL/dy alongside dL/dx (no weight-gradient kernels run), and W runs each module's
    local backward ``grad(y, own params, dL/dy)``. That is exact when every parameter belongs to one module
    called once per forward; otherwise (a parameter shared by two modules of the stage, a module called twice,
    a non-tensor output) the step falls back to differentiating the whole stage in W. The hooks stay on the
    user's modules but record nothing outside a pipeline forward.
    """

    def __init__(self, stage: nn.Module) -> None:
        self.modules = [m for m in stage.modules() if next(m.parameters(recurse=False), None) is not None]
        owners = [id(q) for m in self.modules for q in m.parameters(recurse=False)]
        self.exact = len(owners) == len(set(owners))
        self.active: list[tuple[nn.Module, Any]] | None = None
        for m in self.modules:
            m.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.active is not None:
            self.active.append((module, output))

    def run(self, stage: nn.Module, x: Tensor) -> tuple[Tensor, list[tuple[nn.Module, Tensor]] | None]:
        """``stage(x)`` and the captured (module, output) pairs, or ``None`` when W must use the fallback."""
        self.active = []
        try:
            out = stage(x)
        finally:
            got, self.active = self.active, None
        got = [(m, y) for m, y in got if any(q.requires_grad for q in m.parameters(recurse=False))]  # not frozen
        ok = (self.exact and len({id(m) for m, _ in got}) == len(got)
              and all(isinstance(y, Tensor) and y.requires_grad for _, y in got))
        return out, (got if ok else None)


def weight_gradients(stage: nn.Module, out: Tensor, grad: Any) -> None:
    """W for one (stage, micro-batch): ``grad`` is the list of ((module, y), dL/dy) pairs B left, or, when the
    capture fell back, the stage output's gradient (``out`` is then differentiated again). Accumulates ``.grad``."""
    if isinstance(grad, list):  # captured: W_k = local backward of module k from its output's gradient
        jobs = [([q for q in mod.parameters(recurse=False) if q.requires_grad], y, g) for (mod, y), g in grad
                if g is not None]
    else:  # fallback: differentiate the whole stage again (a parameter used twice, see WeightCapture)
        jobs = [([q for q in stage.parameters() if q.requires_grad], out, grad)]
    for params, root, g in jobs:
        for q, gq in zip(params, torch.autograd.grad(root, params, g, retain_graph=True, allow_unused=True)):
            if gq is not None:
                q.grad = gq if q.grad is None else q.grad.add_(gq)
