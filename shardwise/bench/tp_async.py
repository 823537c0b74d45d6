"""The async tensor-parallel half of ``shardwise bench tp`` (``--async-tp``): pairing each overlapped variant with
its unoverlapped twin, and timing the unoverlapped variants' share of a step inside the tp collectives."""

from __future__ import annotations

import time
from typing import Callable

import torch

__all__ = ["sync_twin", "async_twins", "comm_share", "add_comm_shares"]


def sync_twin(name: str) -> str | None:
    """The unoverlapped variant an ``-async`` one is paired with (``sw-sp-async`` → ``sw-sp``); None otherwise."""
    return name[:-len("-async")] if name.endswith("-async") else None


def async_twins(names: list[str]) -> list[str]:
    """The ``-async`` twins of the unoverlapped sw variants in ``names`` that are not selected already."""
    return [f"{n}-async" for n in names if n.startswith("sw") and sync_twin(n) is None and f"{n}-async" not in names]


def add_comm_shares(rows: list[dict], steps: dict[str, Callable[[], float]], count: int, mesh, cuda: bool) -> None:
    """Set each row's ``comm_share``: measured for the unoverlapped sw variants, NaN for the others."""
    for row in rows:
        name = str(row["variant"])
        mine = name.startswith("sw") and sync_twin(name) is None
        row["comm_share"] = comm_share(steps[name], count, mesh, cuda) if mine else float("nan")


def comm_share(step: Callable[[], float], count: int, mesh, cuda: bool) -> float:
    """Seconds inside the tp collectives of the model's layers (blocking calls: transfer and waiting for the
    peers) over the seconds of ``count`` steps, summed over the tp ranks. Wraps the collectives the
    differentiable conversions call (``comm.autograd``) with timers while it runs. Collective over ``tp``."""
    import shardwise as sw
    from ..comm import autograd as cag

    spent = [0.0]

    def timed(fn: Callable) -> Callable:
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - t
        return call

    saved = {k: getattr(cag, k) for k in ("all_gather", "all_reduce", "reduce_scatter")}
    sw.comm.barrier(mesh, "tp")
    total = 0.0
    try:
        for k, fn in saved.items():
            setattr(cag, k, timed(fn))
        for _ in range(count):
            t = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            total += time.perf_counter() - t
    finally:
        for k, fn in saved.items():
            setattr(cag, k, fn)
    sums = torch.tensor([spent[0], total], dtype=torch.float64)
    sw.comm.all_reduce(sums, mesh, "tp")
    return float(sums[0] / sums[1])
