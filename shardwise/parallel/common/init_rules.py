"""Initial values that do not depend on the layout: a parameter's values are a function of (seed, its name,
element index) only, so one device and every sharded layout hold the same numbers, and a rank can draw just
the elements it keeps.

A model states *how* each parameter starts as plain data — ``Normal(std=0.02)``, ``Uniform(-a, a)``,
``Constant(0.0)`` — through ``param_init(name)``; ``draw`` produces any contiguous range of the flattened
tensor. Random rules are counter-based at block granularity: the flat index space of a parameter is cut into
blocks of ``BLOCK`` elements, and block ``k`` is drawn by torch's generator seeded from a hash of
``(seed, name, k)``. Drawing elements ``[a, b)`` touches only the blocks that overlap it (at most two partial
blocks more than the range itself), so the cost of materialising a shard grows with the shard, not the model.
Values are drawn in fp32 and cast to the parameter's dtype.

Pure: nothing here communicates.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Union

import torch

__all__ = ["Normal", "Uniform", "Constant", "InitRule", "BLOCK", "draw", "draw_full", "block_seed"]

BLOCK = 1 << 16
"""Elements per independently seeded block (64 Ki: seeding costs ~µs, small enough that a shard's edges waste
little)."""


@dataclass(frozen=True)
class Normal:
    """N(mean, std²) per element."""

    mean: float = 0.0
    std: float = 1.0

    def __post_init__(self) -> None:
        if not self.std >= 0:
            raise ValueError(f"Normal(std={self.std}) needs std >= 0")


@dataclass(frozen=True)
class Uniform:
    """U[low, high) per element."""

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not self.high >= self.low:
            raise ValueError(f"Uniform(low={self.low}, high={self.high}) needs low <= high")


@dataclass(frozen=True)
class Constant:
    """Every element ``value`` (``Constant(0.0)`` for biases, ``Constant(1.0)`` for norm scales)."""

    value: float = 0.0


InitRule = Union[Normal, Uniform, Constant]


def block_seed(seed: int, key: str, block: int) -> int:
    """The 63-bit seed of block ``block`` of the parameter named ``key`` under run seed ``seed``."""
    digest = hashlib.blake2b(f"{int(seed)}\x00{key}\x00{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _block(rule: InitRule, seed: int, key: str, k: int, n: int) -> torch.Tensor:
    """Block ``k`` of ``n`` elements (fp32, CPU)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(block_seed(seed, key, k))
    out = torch.empty(n, dtype=torch.float32, device="cpu")
    if isinstance(rule, Normal):
        return out.normal_(rule.mean, rule.std, generator=g)
    return out.uniform_(rule.low, rule.high, generator=g)


def draw(rule: InitRule, seed: int, key: str, numel: int, start: int, stop: int,
         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Elements ``[start, stop)`` of the flattened initial value of parameter ``key`` (``numel`` elements in
    all): a 1-D CPU tensor of ``stop - start`` elements in ``dtype``. The same elements whatever the range."""
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of {numel} elements")
    if isinstance(rule, Constant):
        return torch.full((stop - start,), rule.value, dtype=dtype)
    if not isinstance(rule, (Normal, Uniform)):
        raise TypeError(f"unknown init rule {rule!r} for {key!r}; use Normal, Uniform or Constant")
    out = torch.empty(stop - start, dtype=dtype)
    k = start // BLOCK
    while k * BLOCK < stop:
        lo = k * BLOCK
        values = _block(rule, seed, key, k, min(BLOCK, numel - lo))  # (n,) fp32
        a, b = max(start, lo), min(stop, lo + values.numel())
        out[a - start:b - start] = values[a - lo:b - lo]
        k += 1
    return out


def draw_full(rule: InitRule, seed: int, key: str, shape: tuple[int, ...] | torch.Size,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The whole initial value of ``key`` as a tensor of ``shape``."""
    numel = 1
    for s in shape:
        numel *= int(s)
    return draw(rule, seed, key, numel, 0, numel, dtype).view(tuple(shape))
