"""Point-to-point transport for our own collective algorithms, addressed by position in an axis group.

Every tensor travels as raw bytes (a ``uint8`` view of a contiguous tensor), so any dtype the algorithms
accept (bf16 included) crosses any backend, and every message is counted by ``CommCounter``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .counter import record_message

__all__ = ["AxisLink", "wait_all"]


@dataclass(frozen=True)
class AxisLink:
    """The ranks of one mesh-axis group, seen from one member: ``index`` is this rank's coordinate."""

    group: dist.ProcessGroup
    ranks: tuple[int, ...]
    """Global ranks in coordinate order."""
    index: int

    @property
    def size(self) -> int:
        return len(self.ranks)

    def isend(self, t: torch.Tensor, to: int, tag: int = 0) -> dist.Work | None:
        """Start sending ``t`` (contiguous) to group position ``to``; ``None`` for an empty tensor."""
        if t.numel() == 0:
            return None
        assert t.is_contiguous(), "p2p sends need contiguous tensors"
        record_message(t.numel() * t.element_size(), sent=True)
        return dist.isend(_as_bytes(t), dst=self.ranks[to], group=self.group, tag=tag)

    def irecv(self, t: torch.Tensor, frm: int, tag: int = 0) -> dist.Work | None:
        """Start receiving into ``t`` (contiguous) from group position ``frm``; ``None`` for an empty tensor."""
        if t.numel() == 0:
            return None
        assert t.is_contiguous(), "p2p receives need contiguous tensors"
        record_message(t.numel() * t.element_size(), sent=False)
        return dist.irecv(_as_bytes(t), src=self.ranks[frm], group=self.group, tag=tag)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # (n,) dtype -> (n * itemsize,) uint8 sharing storage; 0-d tensors are viewed as 1-element first.
    return t.reshape(-1).view(torch.uint8)


def wait_all(works: list[dist.Work | None]) -> None:
    for w in works:
        if w is not None:
            w.wait()
