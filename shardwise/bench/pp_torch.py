"""``shardwise bench pp``, the per-rank runners: torch's ``torch.distributed.pipelining`` on the same stages as
ours, one training step of either as a plain callable, and an activation-memory meter.

Torch's side is built from a second copy of the model (same seed, so the same weights) cut at the boundaries
our pipeline chose (``Pipeline.stage_names()``), each stage wrapped in ``PipelineStage`` on the pipeline
axis' process group, stage ``s`` on pipeline coordinate ``s % p`` (torch's default "loop" placement, as ours):

    gpipe        ScheduleGPipe
    1f1b         Schedule1F1B
    zb-h1        ScheduleInterleavedZeroBubble with one stage per rank (the paper's ZB-H1 / "ZB1P")
    interleaved  ScheduleInterleaved1F1B with two stages per rank

A step is forward + backward over the micro-batches and ``zero_grad(set_to_none=True)`` on both sides (no
optimizer: it is the same on both and not pipelined). Torch divides the gradients by the micro-batch count
(``scale_grads``), ours differentiates ``loss / m``: the same gradients.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import Tensor, nn

from ..mesh import Mesh
from ..parallel.pipeline.stage import build_stages

__all__ = ["TORCH_SCHEDULES", "torch_runner", "our_runner", "SavedActivations"]

TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zb-h1": "ScheduleInterleavedZeroBubble",
                   "interleaved": "ScheduleInterleaved1F1B"}
Step = Callable[[Tensor, Tensor], float]


def our_runner(pipe: Any) -> Step:
    """One step of ``sw.pipeline``: returns the mean loss (the same float on every rank)."""
    def step(x: Tensor, y: Tensor) -> float:
        loss = pipe.step(x, y)
        pipe.zero_grad(set_to_none=True)
        return loss
    return step


def torch_runner(name: str, model: nn.Module, pipe: Any, mesh: Mesh, axis: str,
                 loss_fn: Callable[[Tensor, Tensor], Tensor]) -> tuple[Step, list[nn.Module]]:
    """Torch's schedule ``name`` over ``model`` cut where ``pipe`` cut its copy; returns (step, local stage
    modules). The step returns the mean micro-batch loss on the last rank and nan elsewhere."""
    from torch.distributed import pipelining

    p, me = mesh.size(axis), mesh.coord(axis)
    names = pipe.stage_names()
    n = len(names)
    split = [names[s][0] for s in range(1, n)]  # a stage's first module names the unit that starts it
    modules = [s.to(mesh.device) for s in build_stages(model, n, split)]
    local = [modules[s] for s in range(me, n, p)]
    stages = [pipelining.PipelineStage(modules[s], s, n, mesh.device, group=mesh.group(axis))
              for s in range(me, n, p)]
    cls = getattr(pipelining, TORCH_SCHEDULES[name])
    single = name in ("gpipe", "1f1b")  # PipelineScheduleSingle takes one stage, the others a list
    sched = cls(stages[0] if single else stages, n_microbatches=pipe.microbatches, loss_fn=loss_fn)
    first, last = me == 0, me == (n - 1) % p

    def step(x: Tensor, y: Tensor) -> float:
        losses: list[Tensor] = []
        args = (x,) if first else ()
        kwargs: dict[str, Any] = {"target": y, "losses": losses, "return_outputs": False} if last else {}
        sched.step(*args, **kwargs)
        for mod in local:
            mod.zero_grad(set_to_none=True)
        return float(torch.stack([t.detach() for t in losses]).mean()) if losses else float("nan")
    return step, local


class _Held:
    """A saved tensor (detached: no reference cycle through its grad_fn) that counts itself while alive."""

    __slots__ = ("meter", "t", "key")

    def __init__(self, meter: "SavedActivations", t: Tensor, key: int) -> None:
        self.meter, self.t, self.key = meter, t.detach(), key
        meter._add(key, t.untyped_storage().nbytes())

    def __del__(self) -> None:
        self.meter._drop(self.key)


class SavedActivations:
    """``with SavedActivations(params) as meter: step()`` — ``meter.peak`` is the most bytes of tensors autograd
    saved for backward that this process held at once (each storage once; storages of ``exclude``, e.g. the
    parameters, not counted). It is the activation memory a schedule keeps alive; it does not see the
    allocator's caching, gradients, communication buffers or tensors the runtime keeps outside autograd."""

    def __init__(self, exclude: Iterable[Tensor]) -> None:
        self.skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.refs: dict[int, list[int]] = {}  # storage data_ptr -> [holders, bytes]
        self.now = self.peak = 0
        self._hooks: Any = None

    def _add(self, key: int, nbytes: int) -> None:
        ref = self.refs.setdefault(key, [0, nbytes])
        if ref[0] == 0:
            self.now += nbytes
            self.peak = max(self.peak, self.now)
        ref[0] += 1

    def _drop(self, key: int) -> None:
        ref = self.refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.now -= ref[1]
            del self.refs[key]

    def _pack(self, t: Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        return t if key in self.skip or key == 0 else _Held(self, t, key)

    @staticmethod
    def _unpack(held: Any) -> Tensor:
        return held.t if isinstance(held, _Held) else held

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)
