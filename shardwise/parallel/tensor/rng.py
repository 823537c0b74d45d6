"""Random number streams of a tensor-parallel model: shared where activations are replicated, per tp rank
where they are split.

Dropout on a *replicated* activation must draw the same mask on every tp rank (else the replicas of one
logical tensor diverge); dropout on a *split* activation (local heads, a sequence slice) must draw
independent masks (else every shard repeats one mask). The shared stream is the ordinary default generator
of the mesh's device — seed it identically on every tp rank, as for building the model. Entering a split
region draws one number ``r`` from the default CPU generator (the same draw on every tp rank, so the shared
streams stay in step), then seeds the device's default generator from ``(r, seed, tp coord)`` for the
region (``nn.Dropout`` and ``scaled_dot_product_attention`` need no change); leaving restores the shared
state saved on entry.

Because a split region's seed is a function of the shared CPU stream at entry, activation checkpointing
(which restores the CPU and device generators before recomputing) replays the same split masks too.

Regions: without sequence parallelism a split region runs from the end of a column-parallel layer to the
start of the next row-parallel layer; with it, the whole forward is split (every activation outside those
pairs is sequence-split).
"""

from __future__ import annotations

import torch

__all__ = ["RNGStreams", "split_seed"]


def split_seed(draw: int, seed: int, coord: int) -> int:
    """Seed of tp rank ``coord``'s split region: distinct per coord, mixed with the shared ``draw``."""
    return (draw * 1_000_003 + seed * 7_919 + 2718 + 104_729 * coord) % (2**63 - 1)


def _generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator


class RNGStreams:
    """Split-region switching for one parallelized model on ``device`` (see module docstring). Local."""

    def __init__(self, device: torch.device, seed: int, coord: int) -> None:
        self.device, self.seed, self.coord = device, seed, coord
        self._saved_shared: torch.Tensor | None = None

    @property
    def in_split(self) -> bool:
        return self._saved_shared is not None

    def enter_split(self) -> None:
        """Seed the device's default generator for this rank's split region (no-op if already in one)."""
        if self._saved_shared is None:
            draw = int(torch.randint(0, 2**62, (1,), generator=torch.default_generator))  # host-side, no sync
            gen = _generator(self.device)
            self._saved_shared = gen.get_state()
            gen.manual_seed(split_seed(draw, self.seed, self.coord))

    def leave_split(self) -> None:
        """Restore the shared stream saved on entry (no-op outside a split region)."""
        if self._saved_shared is not None:
            _generator(self.device).set_state(self._saved_shared)
            self._saved_shared = None
