"""How the optimizer's update runs (``optimizer.implementation``), and the device-side skip of a non-finite step.

``fused``: one kernel per device and dtype over every parameter (``torch._fused_adamw_`` / ``_fused_sgd_``);
``foreach``: batched per-op kernels (``torch._foreach_*``); ``loop``: one parameter at a time. ``auto`` picks
fused on CUDA when every parameter allows it (a dense floating tensor on the GPU) and leaves the choice to torch
otherwise (on CPU: the loop, which keeps CPU runs bit-identical to earlier versions). The three agree to
rounding (tests/unit/test_optimizer_impl.py).

A fused optimizer also takes a ``found_inf`` tensor (torch's ``GradScaler`` protocol): when it holds 1 the
kernel leaves weights, moments and the step count untouched. ``set_found_inf`` hands it the non-finite
guard's agreed flag, so the decision "step or skip" is made on the device, without a host read
(``runtime/host_overlap.py``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .config_schema import OptimizerConfig

__all__ = ["implementation_kwargs", "check_implementation", "torch_optimizers", "supports_found_inf",
           "set_found_inf", "fused_devices"]


def fused_devices() -> list[str]:
    """Device types this torch has fused optimizer kernels for (``cuda`` and ``cpu`` since torch 2.4)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    return list(_get_fused_kernels_supported_devices())


def _fusable(p: torch.Tensor, supported: Sequence[str]) -> bool:
    return p.layout == torch.strided and torch.is_floating_point(p) and p.device.type in supported


def implementation_kwargs(params: Sequence[nn.Parameter], o: OptimizerConfig) -> dict[str, Any]:
    """The ``fused``/``foreach`` keyword arguments of ``torch.optim.AdamW``/``SGD`` for ``o.implementation`` over
    ``params``. ``auto``: ``fused=True`` when every parameter is a dense floating CUDA tensor, else nothing (torch's
    own default: foreach on CUDA, the loop on CPU). Pure."""
    if o.implementation == "fused":
        return {"fused": True}
    if o.implementation == "foreach":
        return {"foreach": True}
    if o.implementation == "loop":
        return {"foreach": False}
    supported = fused_devices()
    if params and all(p.device.type == "cuda" and _fusable(p, supported) for p in params):
        return {"fused": True}
    return {}


def check_implementation(o: OptimizerConfig, device_type: str, supported: Sequence[str] | None = None) -> None:
    """Before launch: ``optimizer.implementation = fused`` needs fused kernels for ``o.name`` on ``device_type``
    (``supported``: the device types that have them, default this torch's). Raises a one-line ``ValueError``
    naming the fix."""
    if o.implementation != "fused":
        return
    supported = fused_devices() if supported is None else list(supported)
    optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[o.name]
    takes_fused = "fused" in optimizer.__init__.__code__.co_varnames
    if not takes_fused or device_type not in supported:
        where = (f"this torch ({torch.__version__}) has no fused {o.name}" if not takes_fused else
                 f"this torch has fused optimizer kernels for {', '.join(supported)}, not for {device_type}")
        raise ValueError(f"optimizer.implementation = 'fused': {where}; use --optimizer.implementation auto (fused "
                         f"where possible, else foreach) or foreach")


def torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim.Optimizer`` s that update the weights: ``optimizer`` itself, or the one inside a
    ``ZeroOptimizer`` (``sw.zero``, a pipeline's ZeRO-1). Empty when neither. Pure."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if isinstance(inner, torch.optim.Optimizer) else []


def supports_found_inf(optimizer: Any) -> bool:
    """Whether every parameter group of the optimizer(s) that update the weights is fused (and so honours a
    ``found_inf`` tensor: a step skipped on the device). Pure."""
    inner = torch_optimizers(optimizer)
    return bool(inner) and all(g.get("fused") for o in inner for g in o.param_groups)


def set_found_inf(optimizer: Any, flag: torch.Tensor | None) -> None:
    """Hand ``flag`` (fp32, shape ``(1,)`` or ``()``, on the parameters' device; 1 = skip) to the next
    ``step()`` of every fused optimizer inside ``optimizer``; ``None`` removes it. Local, no host sync."""
    for inner in torch_optimizers(optimizer):
        if flag is None:
            inner.__dict__.pop("found_inf", None)
        else:
            inner.found_inf = flag.reshape(())  # type: ignore[attr-defined]  # torch's GradScaler protocol
