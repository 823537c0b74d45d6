"""``sw.memory_report``: this rank's model-state bytes — parameters, gradients, optimizer state — and peak.

Bytes are counted from the *storages* of the live tensors the model and optimizer own, each storage once
(a view, an aliased master shard or a gradient that is a view of a flat buffer costs nothing extra; a
stage-3 unit whose storage was resized to 0 costs 0). A storage shared by two categories is counted in the
first of params, grads, optimizer. This is exact on every device and is what the ZeRO formulas describe.

``peak``: on CUDA, the caching allocator's high-water mark of allocated bytes
(``torch.cuda.max_memory_allocated``: everything, activations included). On CPU there is no allocator
statistic, so it is the highest model-state total (params + grads + optimizer) seen at the points a ZeRO
wrapper notes it (each step) and now — activations and communication buffers are not included there.
Local (no communication).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn as nn

__all__ = ["memory_report", "storage_bytes", "PeakTracker"]

CATEGORIES = ("params", "grads", "optimizer")


def storage_bytes(tensors: dict[str, Iterable[torch.Tensor | None]]) -> dict[str, int]:
    """Bytes per category, each storage counted once (in the first category that holds it)."""
    seen: set[int] = set()
    out = {c: 0 for c in tensors}
    for cat, ts in tensors.items():
        for t in ts:
            if t is None:
                continue
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or ptr in seen:
                continue
            seen.add(ptr)
            out[cat] += size
    return out


class PeakTracker:
    """Running maximum of model-state totals (CPU ``peak``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def note(self, total: int) -> None:
        self.peak = max(self.peak, total)


def _plain_tensors(model: nn.Module, opt: Any) -> dict[str, list[torch.Tensor]]:
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = []
    if opt is not None:
        for s in getattr(opt, "state", {}).values():
            state += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return {"params": params, "grads": grads, "optimizer": state}


def memory_report(model: nn.Module, opt: Any = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer", "peak"}`` bytes of this rank (see module docstring). ``model`` is
    a ``sw.zero`` model (with its optimizer) or any plain module (with any torch optimizer). Local."""
    probe, tensors = model, None
    while tensors is None:
        if callable(getattr(probe, "memory_tensors", None)):
            tensors = probe.memory_tensors(opt)
        elif isinstance(getattr(probe, "module", None), nn.Module):
            probe = probe.module
        else:
            tensors = _plain_tensors(model, opt)
    counts = storage_bytes({c: tensors[c] for c in CATEGORIES})
    # sw.zero releases its gradient shards when a step consumes them: its last step's counts, noted just before
    last = getattr(probe, "last_step_bytes", None)
    if isinstance(last, dict):
        counts = {c: max(counts[c], int(last.get(c, 0))) for c in CATEGORIES}
    total = sum(counts.values())
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    else:
        tracker = getattr(probe, "_peak", None)
        if isinstance(tracker, PeakTracker):
            tracker.note(total)
            peak = tracker.peak
        else:
            peak = total
    return {**counts, "peak": peak}
