"""Global-tensor metadata on plain tensors (parameters, buffers).

A sharded parameter stays an ordinary ``nn.Parameter`` holding this rank's piece — so optimizers, hooks and
``state_dict`` work unchanged — and carries its global description (``TensorSpec`` + ``Mesh``) as an attribute.
``as_global(p)`` turns it into a ``GlobalTensor`` view (no copy), e.g. to compare with the single-device
model or to save it under another layout.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..mesh import Mesh
from .global_tensor import GlobalTensor, to_global
from .placement import Placement

__all__ = ["annotate", "as_global", "spec_of"]

_ATTR = "_shardwise_global"


def annotate(t: torch.Tensor, mesh: Mesh, sbp: Sequence[Placement] | str,
             shape: Sequence[int] | None = None) -> torch.Tensor:
    """Attach the global description of the local piece ``t`` (validated like ``to_global``); returns ``t``."""
    g = to_global(t, mesh, sbp, shape)
    setattr(t, _ATTR, (g.spec, mesh))
    return t


def spec_of(t: torch.Tensor):
    """The ``TensorSpec`` attached to ``t``, or None for a plain (replicated, un-annotated) tensor."""
    meta = getattr(t, _ATTR, None)
    return meta[0] if meta is not None else None


def as_global(t: torch.Tensor) -> GlobalTensor | None:
    """A ``GlobalTensor`` over the annotated local tensor ``t`` (sharing storage), or None if not annotated."""
    meta = getattr(t, _ATTR, None)
    if meta is None:
        return None
    spec, mesh = meta
    return GlobalTensor(t, spec, mesh)
