"""Shared pieces of the training-step benchmarks (``bench dp``, ``bench zero``): the reference-GPT workload
each rank builds, and the step timer. One place, so every benchmark times steps the same way."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from ..mesh import Mesh
from ..models.gpt import GPTConfig, synthetic_batch

__all__ = ["time_steps", "gpt_workload", "set_bench_threads"]

Batch = tuple[torch.Tensor, torch.Tensor]


def time_steps(step: Callable[[torch.Tensor, torch.Tensor], object], batches: list[Batch], count: int) -> list[float]:
    """Seconds of each of ``count`` calls of ``step(x, y)``, cycling through ``batches`` (CUDA synchronised)."""
    out = []
    for k in range(count):
        x, y = batches[k % len(batches)]
        t = time.perf_counter()
        step(x, y)
        if x.is_cuda:
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return out


def gpt_workload(preset: str, *, seq: int, batch: int, mesh: Mesh, axis: str,
                 n_batches: int = 4) -> tuple[GPTConfig, list[Batch]]:
    """The preset's config with ``block_size=seq`` and no dropout, and ``n_batches`` synthetic (b, seq) batches
    that differ per coordinate along ``axis`` (each data-parallel rank sees its own data)."""
    base = GPTConfig.preset(preset)
    cfg = GPTConfig(**{**base.to_dict(), "block_size": max(seq, 1), "dropout": 0.0})
    gen = torch.Generator().manual_seed(1000 + mesh.coord(axis))
    batches = [tuple(t.to(mesh.device) for t in synthetic_batch(batch, seq, cfg.vocab_size, gen))
               for _ in range(n_batches)]
    return cfg, batches  # type: ignore[return-value]


def set_bench_threads(threads: int, world_size: int) -> None:
    """``threads`` intra-op threads, or the cores shared evenly among the local ranks when 0."""
    torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // max(1, world_size)))
