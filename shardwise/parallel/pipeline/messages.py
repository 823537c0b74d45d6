"""What one stage-to-stage message carries: one tensor, or several packed into one byte buffer.

A chain model's stage sends one tensor (the hidden states) as is. A stage cut from a captured graph sends every
value the later stages need (hidden states, position ids, a mask, rotary cos/sin): those travel as ONE message
— each tensor's bytes, 16-byte aligned, concatenated into a ``uint8`` buffer — so a boundary costs one
send/receive pair per micro-batch whatever it carries (one extra copy on each side). The receiver views the
buffer back as the tensors (no copy).

``Spec`` (dtype, shape, requires_grad) describes each tensor. The first message on a boundary is preceded by a
metadata message of ``n x META_LEN`` int64s; the gradient message going back packs the gradients of the tensors
that require grad, in the same order.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
from torch import Tensor

__all__ = ["Spec", "META_LEN", "encode_meta", "decode_meta", "alloc", "pack", "unpack"]

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
          torch.int16, torch.int8, torch.uint8)
MAX_DIMS = 8
META_LEN = 3 + MAX_DIMS  # [dtype code, requires_grad, ndim, sizes...]
_ALIGN = 16


class Spec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def spec_of(t: Tensor) -> Spec:
    return Spec(t.dtype, tuple(t.shape), bool(t.requires_grad))


def encode_meta(stage: int, tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    meta = torch.zeros(len(tensors) * META_LEN, dtype=torch.int64)
    for k, t in enumerate(tensors):
        if t.dim() > MAX_DIMS or t.dtype not in DTYPES:
            raise ValueError(f"stage {stage} output {k} must have at most {MAX_DIMS} dims and a dtype in "
                             f"{[str(d) for d in DTYPES]}, got {t.dtype} {tuple(t.shape)}")
        row = [DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
        meta[k * META_LEN:k * META_LEN + len(row)] = torch.tensor(row, dtype=torch.int64)
    return meta.to(device)


def decode_meta(meta: Tensor) -> list[Spec]:
    rows = meta.cpu().reshape(-1, META_LEN).tolist()
    return [Spec(DTYPES[r[0]], tuple(r[3:3 + r[2]]), bool(r[1])) for r in rows]


def _nbytes(spec: Spec) -> int:
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=spec.dtype).element_size()


def _padded(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def alloc(specs: Sequence[Spec], device: torch.device) -> Tensor:
    """The receive buffer for a message of ``specs``."""
    if len(specs) == 1:
        return torch.empty(specs[0].shape, dtype=specs[0].dtype, device=device)
    return torch.empty(sum(_padded(_nbytes(s)) for s in specs), dtype=torch.uint8, device=device)


def pack(tensors: Sequence[Tensor], device: torch.device) -> Tensor:
    """One tensor as is (contiguous); several (or none) as one aligned byte buffer."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8, device=device)
    if len(tensors) == 1:
        return tensors[0].contiguous()
    parts = []
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        pad = _padded(raw.numel()) - raw.numel()
        parts.append(raw)
        if pad:
            parts.append(raw.new_zeros(pad))
    return torch.cat(parts)


def unpack(buf: Tensor, specs: Sequence[Spec], leaves: bool) -> list[Tensor]:
    """The tensors of a received message. ``leaves``: forward activations become autograd leaves that require
    grad as their sender's did (backward leaves dL/dx in ``x.grad``); gradients stay plain tensors."""
    if len(specs) == 1:
        out = [buf]
    else:
        out, at = [], 0
        for s in specs:
            n = _nbytes(s)
            out.append(buf[at:at + n].view(s.dtype).reshape(s.shape).detach())
            at += _padded(n)
    if leaves:
        for t, s in zip(out, specs):
            t.requires_grad_(s.requires_grad and t.is_floating_point())
    return out
