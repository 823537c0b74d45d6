"""Random number streams of a tensor-parallel model: one shared, one per tp rank.

Dropout on a *replicated* activation must draw the same mask on every tp rank (else the replicas of one
logical tensor diverge); dropout on a *split* activation (local heads, a sequence slice) must draw
independent masks (else every shard repeats the same mask). The shared stream is the ordinary default
generator of the mesh's device — seed it identically on every tp rank, as for building the model. The split
stream is a second generator state seeded from ``(seed, tp coord)``; while a split region runs, it is swapped
into the default generator (so ``nn.Dropout`` and ``scaled_dot_product_attention`` need no changes) and
swapped out afterwards, leaving the shared stream exactly where it was.

Regions: without sequence parallelism the split region runs from the end of a column-parallel layer to the
start of the next row-parallel layer; with it, the whole forward is split (every activation outside those
pairs is sequence-split). Limitation: activation checkpointing that recomputes a split region replays the
shared stream only, so split-region dropout masks differ in the recomputation (use dropout 0 there).
"""

from __future__ import annotations

import torch

__all__ = ["RNGStreams", "split_seed"]


def split_seed(seed: int, coord: int) -> int:
    """Seed of tp rank ``coord``'s split stream: distinct per coord, far from ``seed`` itself."""
    return (seed * 1_000_003 + 2718 + 7919 * coord) % (2**63 - 1)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class RNGStreams:
    """The shared and split streams of one parallelized model on ``device`` (see module docstring)."""

    def __init__(self, device: torch.device, seed: int, coord: int) -> None:
        self.device = device
        gen = _generator(device)
        saved = gen.get_state()
        gen.manual_seed(split_seed(seed, coord))
        self._split_state = gen.get_state()
        gen.set_state(saved)
        self._saved_shared: torch.Tensor | None = None

    @property
    def in_split(self) -> bool:
        return self._saved_shared is not None

    def enter_split(self) -> None:
        """Make the default generator draw from this rank's split stream (no-op if already)."""
        if self._saved_shared is None:
            gen = _generator(self.device)
            self._saved_shared = gen.get_state()
            gen.set_state(self._split_state)

    def leave_split(self) -> None:
        """Save the split stream's progress and restore the shared stream (no-op if not in a split region)."""
        if self._saved_shared is not None:
            gen = _generator(self.device)
            self._split_state = gen.get_state()
            gen.set_state(self._saved_shared)
            self._saved_shared = None
