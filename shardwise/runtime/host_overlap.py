"""The step read one step late: on CUDA the host queues step n+1 before it reads step n's loss.

Reading a loss (``float(loss)``) or the non-finite flag (``flag.item()``) makes the host wait until the device
has run everything queued before it; the device then idles while the host queues the next step's first
kernels (the optimizer's Python, the next batch, the forward's launches: about a millisecond per step, a
few percent of a 350M model's step on one H100/H200). So, on CUDA, a step ends with everything still queued:

* the non-finite guard's flag (``nonfinite.local_flag``, agreed over the mesh by ``nonfinite.agreed``: an
  all-reduce on the device, no host read) goes to the fused optimizer as ``found_inf`` — the optimizer
  kernel itself skips a non-finite step (weights, moments and step count untouched: ``optimizer_impl.py``);
* the mean loss over dp stays a device tensor (its all-reduce queued);
* the phase times are CUDA events (``strategy.plain.accumulate``'s marks, and two more here).

``PendingStep`` holds them; the trainer reads it (``read``) after it has queued the next step, and applies the
skip policy then (``train.nonfinite``: count the skip, or stop). Before a checkpoint, a validation pass and the
last step it reads at once, so a checkpoint never holds a step whose flag nobody has read.

Where the host still waits inside a step, and why: gradient clipping (the norm is logged per step as a float
and decides nothing on the device here: the step reads at once), loss-masked data (the step's count of
targets scales the loss, read as an int before the passes; the step's end is still read late), a pipeline (``pipe.step`` returns its loss as a float after its
schedule's point-to-point transfers), and fp16 loss scaling inside ZeRO (the overflow check). On CPU nothing
is gained (the host does the work itself), so CPU runs read at once and stay as before.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..mesh import Mesh
from .config_schema import Config
from .nonfinite import Grad, agreed, local_flag
from .optimizer_impl import set_found_inf, supports_found_inf
from .strategy.plain import DataParallelSteps, seconds

__all__ = ["PendingStep", "can_defer", "finish_deferred", "read"]

Marks = list[tuple[Any, Any, Any]]
"""(before forward, after forward, after backward) per pass: CUDA events, or host clock readings on CPU."""


@dataclass
class PendingStep:
    """One optimizer step's results. ``flag is None``: decided and read on the host already (``loss`` a float,
    ``t`` complete). Otherwise still on the device: ``loss`` a 0-d fp32 tensor (dp mean), ``flag`` shape (1,)
    fp32 (1 = a rank saw a non-finite value, the optimizer skipped), ``t`` without fwd/bwd/opt/comm/step."""

    step: int
    lr: float
    loss: torch.Tensor | float
    t: dict[str, float]
    flag: torch.Tensor | None = None
    marks: Marks = field(default_factory=list)
    ends: tuple[Any, Any] | None = None
    """Marks after the optimizer step and after the loss all-reduce."""
    host: torch.Tensor | None = None
    """``[loss, flag]`` (2,) fp32 in pinned host memory, copied in stream order right after the step; ``done``
    marks that copy. Reading ``loss`` itself would queue its copy behind the *next* step and wait for that too."""
    done: Any = None

    @property
    def deferred(self) -> bool:
        return self.flag is not None


def can_defer(strategy: Any, device: torch.device, cfg: Config) -> bool:
    """Whether steps are read a step late: CUDA, a layout whose passes are ``accumulate``'s (plain, dp, tp,
    ZeRO), a fused optimizer (takes ``found_inf``), no clipping. Loss-masked data still defers the step's end;
    its host wait is earlier, where the step's count of targets is read (see module docstring)."""
    return (device.type == "cuda" and isinstance(strategy, DataParallelSteps) and supports_found_inf(strategy.optimizer)
            and cfg.optimizer.clip_grad_norm == 0)


def _mark(device: torch.device) -> Any:
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def finish_deferred(strategy: Any, mesh: Mesh, loss_sum: torch.Tensor, grads: list[Grad], *, step: int, lr: float,
                    t: dict[str, float], marks: Marks) -> PendingStep:
    """After the passes: agree on the non-finite flag on the device, step the (fused) optimizer with it as
    ``found_inf``, drop the gradients, queue the mean loss over dp. Nothing is read. Collective (mesh)."""
    flag = agreed(local_flag(loss_sum, grads), mesh)  # (1,) fp32, same on every rank once the all-reduces ran
    set_found_inf(strategy.optimizer, flag)
    try:
        strategy.optimizer.step()
    finally:
        set_found_inf(strategy.optimizer, None)
    strategy.optimizer.zero_grad(set_to_none=True)
    after_opt = _mark(mesh.device)
    loss = strategy.mean_loss_tensor(loss_sum)
    ends = (after_opt, _mark(mesh.device))
    host = torch.empty(2, dtype=torch.float32, pin_memory=mesh.device.type == "cuda")
    host.copy_(torch.cat([loss.detach().reshape(1).float(), flag.reshape(1)]), non_blocking=True)
    return PendingStep(step, lr, loss, t, flag, marks, ends, host, _mark(mesh.device))


def read(p: PendingStep, since: float) -> tuple[float, bool, dict[str, float]]:
    """``(loss, skipped, t)`` of a deferred step: waits for its device work (the host's only wait), then the
    phase times from its marks. ``t["step"]``: host clock from ``since`` (when the previous step was read, or
    this one launched) to now — one step's device time once the queue is full. ``t["host_wait_s"]``: how long
    the host blocked here. Local (its collectives were queued by ``finish_deferred``)."""
    assert p.flag is not None and p.ends is not None and p.host is not None
    waited = time.perf_counter()
    if isinstance(p.done, torch.cuda.Event):
        p.done.synchronize()  # the host waits here for step n only, while step n+1 is queued behind it
    loss, bad = float(p.host[0]), bool(p.host[1] > 0)
    now = time.perf_counter()
    t = dict(p.t)
    t["fwd"] = sum(seconds(m0, m1) for m0, m1, _ in p.marks)
    t["bwd"] = sum(seconds(m1, m2) for _, m1, m2 in p.marks)
    last = p.marks[-1][2] if p.marks else p.ends[0]
    t.update(opt=seconds(last, p.ends[0]), comm=t.get("comm", 0.0) + seconds(*p.ends), step=now - since,
             host_wait=now - waited)
    return loss, bad, t
