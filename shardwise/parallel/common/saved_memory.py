"""``SavedTensorPeak``: the high-water mark of the bytes autograd keeps for backward, measured on any device.

On a GPU the caching allocator reports a true peak; a CPU process has no such statistic (its resident size
mixes the interpreter, the allocator's free lists and the model). What training adds on top of the model
states is, to first order, what autograd saves between a forward and its backward — the activations of
every micro-batch in flight. This context manager counts exactly that: each saved tensor's *storage* once
(views share it), added when autograd packs it, removed when the last graph node holding it is freed
(after its backward, or when a graph is dropped). Parameters that autograd saves are model states, not
activations, and are left out. Activations kept by activation checkpointing's own hooks
are the checkpoint's inputs, which this sees; the recomputed ones live only inside one backward and are not
counted. Cheap: one Python call per saved tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["SavedTensorPeak"]


class _Held:
    """What autograd stores instead of the tensor: the tensor plus a weak-referenceable handle whose death
    tells us the graph let go of it."""

    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class SavedTensorPeak:
    """``with SavedTensorPeak() as tracker: loss.backward() ...``; ``tracker.peak`` bytes (see module doc).

    Re-entering the same tracker continues the count, so one tracker can wrap every step of a run."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[int, int] = {}
        self._ctx: Any = None

    def _pack(self, t: torch.Tensor) -> Any:
        base = t
        while base._base is not None:  # a view (e.g. ``weight.t()`` saved by a linear layer)
            base = base._base
        if base.is_leaf and base.requires_grad:  # a parameter: model state, counted by ``memory_report``
            return t
        storage = t.untyped_storage()
        key, size = storage.data_ptr(), storage.nbytes()
        if self._refs.get(key, 0) == 0:
            self.live += size
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        # a detached alias (same storage, same version counter, no grad_fn): holding ``t`` itself would tie a
        # saved *output* to its own graph node, a cycle through C++ that Python's gc cannot break — a graph kept
        # with retain_graph and never run again (the zero-bubble B) would then never be freed
        held = _Held(t.detach())
        weakref.finalize(held, self._release, key, size)
        return held

    def _release(self, key: int, size: int) -> None:
        count = self._refs.get(key, 0) - 1
        if count <= 0:
            self._refs.pop(key, None)
            self.live -= size
        else:
            self._refs[key] = count

    @staticmethod
    def _unpack(held: Any) -> torch.Tensor:
        return held.t if isinstance(held, _Held) else held

    def __enter__(self) -> "SavedTensorPeak":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)
        self._ctx = None
