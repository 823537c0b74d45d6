"""Debug-mode agreement check: before a collective, every rank of the axis compares what it is about to do.

Mismatched calls (different lengths, dtypes, ops or algorithms on different ranks) otherwise hang or return
garbage; with ``Mesh(debug=True)`` they raise ``ValueError`` on every rank, naming each rank's value. The
check itself is one fixed-size native all-gather, so it cannot hang on the mismatch it detects.
"""

from __future__ import annotations

import math
import zlib
from typing import Sequence

import torch

from .ops import ALGORITHMS, REDUCE_OPS, gather_into_tensor

__all__ = ["check_agreement"]

_FIELDS = ("collective", "op", "algorithm", "dtype", "numel", "row size", "sizes")
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all")
# Collectives whose per-rank length may legitimately differ (uneven gathers): compare row size and sizes.
_UNEVEN_OK = ("all_gather", "all_to_all")


def check_agreement(mesh, axis: str, collective: str, t: torch.Tensor, *, op: str = "sum",
                    algorithm: str = "native", sizes: Sequence[int] | None = None) -> None:
    """Collective over ``axis``: raise ``ValueError`` on every rank unless all ranks pass the same signature."""
    dtype_code = zlib.crc32(str(t.dtype).encode()) & 0x7FFFFFFF
    row = math.prod(t.shape[1:]) if t.dim() > 1 else 1
    numel = -1 if collective in _UNEVEN_OK else t.numel()
    sizes_code = zlib.crc32(repr(list(sizes)).encode()) & 0x7FFFFFFF if sizes is not None else 0
    mine = torch.tensor([_COLLECTIVES.index(collective), REDUCE_OPS.index(op), ALGORITHMS.index(algorithm),
                         dtype_code, numel, row, sizes_code], dtype=torch.int64)
    gathered = torch.empty(mesh.size(axis) * len(mine), dtype=torch.int64)
    device = mesh.device
    if device.type != "cpu":
        mine, gathered = mine.to(device), gathered.to(device)
    gather_into_tensor(gathered, mine, group=mesh.group(axis))
    table = gathered.view(mesh.size(axis), len(mine)).cpu()
    bad = [f for k, f in enumerate(_FIELDS) if len(set(table[:, k].tolist())) > 1]
    if bad:
        ranks = mesh.ranks(axis)
        detail = "; ".join(f"{f}: " + ", ".join(f"rank {r}={_decode(f, v)}" for r, v in
                                                zip(ranks, table[:, _FIELDS.index(f)].tolist())) for f in bad)
        raise ValueError(f"ranks of axis {axis!r} disagree on {collective} ({detail}); every rank of the axis "
                         f"must call the same collective with the same shape, dtype, op and algorithm")


def _decode(field: str, value: int) -> str:
    if field == "collective":
        return _COLLECTIVES[value]
    if field == "op":
        return REDUCE_OPS[value]
    if field == "algorithm":
        return ALGORITHMS[value]
    if field in ("dtype", "sizes"):
        return f"#{value:x}"
    return str(value)
