"""Gradient reduce hooks for ``DataParallel``: what happens to one flat bucket of gradients.

A hook is ``hook(bucket) -> fut`` where ``fut.wait()`` returns the *averaged* flat tensor (``bucket.buffer``
itself, reduced in place, or a new tensor of the same length and dtype that is copied back). It is called
on every rank of the axis for every bucket in the same order, so it may issue collectives over
``bucket.mesh``/``bucket.axis``. It must average **every** element of ``bucket.buffer``: the last bucket
ends with a status tail (one element per parameter: 1 where this rank produced no gradient) that
``DataParallel`` uses to find unused parameters without an extra collective.

Built-ins: ``allreduce_hook`` (the default, full precision), ``bf16_compress_hook`` and
``fp16_compress_hook`` (half the bytes on the wire, at the cost of rounding each gradient to 8 resp.
11 significant bits before summing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn as nn

from ... import comm
from ...mesh import Mesh

__all__ = ["Bucket", "CommHook", "Waitable", "allreduce_hook", "bf16_compress_hook", "fp16_compress_hook"]


class Waitable(Protocol):
    """Anything with ``wait() -> Tensor``: ``sw.comm.Handle``, ``torch.futures.Future``."""

    def wait(self) -> torch.Tensor: ...


@dataclass
class Bucket:
    """One flat gradient buffer handed to a comm hook."""

    index: int
    """Position in the launch order (0 = first reduced)."""
    buffer: torch.Tensor
    """1-D: the member gradients back to back (``offsets``), then, on the last bucket only, the status tail."""
    parameters: list[nn.Parameter]
    """Member parameters in buffer order."""
    offsets: list[int]
    """Start of each member's gradient in ``buffer``."""
    mesh: Mesh
    axis: str
    algorithm: str
    """The collective algorithm the wrapper was configured with (``native | ring | tree``)."""

    def gradients(self) -> list[torch.Tensor]:
        """Views of ``buffer`` shaped like each member parameter."""
        return [self.buffer[o:o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.parameters)]


CommHook = Callable[[Bucket], Waitable]


def allreduce_hook(bucket: Bucket) -> Waitable:
    """Average the bucket in place over the axis, asynchronously (one all-reduce)."""
    handle = comm.all_reduce(bucket.buffer, bucket.mesh, bucket.axis, op="avg", algorithm=bucket.algorithm,
                             async_op=True)
    assert isinstance(handle, comm.Handle)
    return handle


class _CastBack:
    """Waits for a low-precision all-reduce, then writes ``scale * result`` back into the full buffer."""

    def __init__(self, handle: comm.Handle, buffer: torch.Tensor, low: torch.Tensor, scale: float) -> None:
        self._handle, self._buffer, self._low, self._scale = handle, buffer, low, scale

    def wait(self) -> torch.Tensor:
        self._handle.wait()
        self._buffer.copy_(self._low)
        if self._scale != 1.0:
            self._buffer.mul_(self._scale)
        return self._buffer

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def _compressed(bucket: Bucket, dtype: torch.dtype, divide_first: bool) -> Waitable:
    n = bucket.mesh.size(bucket.axis)
    if bucket.buffer.dtype == dtype:
        return allreduce_hook(bucket)
    src = bucket.buffer / n if divide_first else bucket.buffer
    low = src.to(dtype)  # (numel,) in half precision: half the bytes on the wire
    handle = comm.all_reduce(low, bucket.mesh, bucket.axis, op="sum", algorithm=bucket.algorithm, async_op=True)
    assert isinstance(handle, comm.Handle)
    return _CastBack(handle, bucket.buffer, low, 1.0 if divide_first else 1.0 / n)


def bf16_compress_hook(bucket: Bucket) -> Waitable:
    """Cast to bfloat16, sum over the axis, cast back, divide by the axis size. bfloat16 keeps float32's
    exponent range, so the sum cannot overflow; dividing after the cast back loses no further precision."""
    return _compressed(bucket, torch.bfloat16, divide_first=False)


def fp16_compress_hook(bucket: Bucket) -> Waitable:
    """Divide by the axis size, cast to float16, sum, cast back. float16 overflows above 65504, so the
    gradients are scaled down *before* the sum (the average then never exceeds the largest input)."""
    return _compressed(bucket, torch.float16, divide_first=True)
