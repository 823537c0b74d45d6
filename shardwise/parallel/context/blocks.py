"""One attention block of the ring: (query rows, key rows), full or causal-diagonal, forward and backward.

Two implementations, equal up to rounding (tests/unit/test_context_layout.py):

- ``math``: plain matmuls in the accumulation dtype (fp32, fp64 for fp64 inputs): exact, portable, any head
  dims; materialises the block's (rows × keys) scores.
- ``flash``: the fused CPU kernel ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward, which
  never holds the whole score matrix. Its backward, given the *final* output and log-sum-exp of the rows,
  returns exactly this block's share of dQ, dK, dV (the softmax statistics are the whole row's).

``select(impl, q, v)`` picks one: ``"auto"`` takes ``flash`` where the kernel exists and applies (CPU tensors,
equal query and value head dims), else ``math``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["MathBlocks", "FlashBlocks", "select", "IMPLS"]

IMPLS = ("auto", "math", "flash")


def acc_dtype(t: Tensor) -> torch.dtype:
    """The accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


def _scores(q: Tensor, k: Tensor, scale: float, diag: bool) -> Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)).mul_(scale)
    if diag:
        n = s.shape[-1]
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool, device=s.device).triu_(1), float("-inf"))
    return s


class MathBlocks:
    name = "math"

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, diag: bool) -> tuple[Tensor, Tensor]:
        """(output, log-sum-exp) of the block in the accumulation dtype."""
        acc = acc_dtype(q)
        s = _scores(q.to(acc), k.to(acc), scale, diag)
        lse = torch.logsumexp(s, dim=-1)
        return torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc)), lse

    @staticmethod
    def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, delta: Tensor,
                 scale: float, diag: bool) -> tuple[Tensor, Tensor, Tensor]:
        """This block's (dQ, dK, dV) given the rows' final output, log-sum-exp and ``delta = rowsum(dO ∘ O)``."""
        acc = acc_dtype(q)
        q, k, v, do = q.to(acc), k.to(acc), v.to(acc), do.to(acc)
        p = torch.exp(_scores(q, k, scale, diag) - lse.unsqueeze(-1))
        ds = p * (torch.matmul(do, v.transpose(-2, -1)) - delta.unsqueeze(-1))
        return (torch.matmul(ds, k).mul_(scale), torch.matmul(ds.transpose(-2, -1), q).mul_(scale),
                torch.matmul(p.transpose(-2, -1), do))


class FlashBlocks:
    name = "flash"

    @staticmethod
    def available(q: Tensor, v: Tensor) -> bool:
        return (q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
                and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, scale: float, diag: bool) -> tuple[Tensor, Tensor]:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diag, scale=scale)
        return out.to(acc_dtype(q)), lse.to(acc_dtype(q))

    @staticmethod
    def backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, delta: Tensor,
                 scale: float, diag: bool) -> tuple[Tensor, Tensor, Tensor]:
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do.to(q.dtype).contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.to(q.dtype).contiguous(),
            lse.to(torch.float32 if q.dtype != torch.float64 else q.dtype).contiguous(), 0.0, diag, scale=scale)
        return dq, dk, dv


def select(impl: str, q: Tensor, v: Tensor) -> type[MathBlocks] | type[FlashBlocks]:
    if impl not in IMPLS:
        raise ValueError(f"ring attention impl={impl!r}; choose one of {IMPLS}")
    if impl == "math" or (impl == "auto" and not FlashBlocks.available(q, v)):
        return MathBlocks
    if not FlashBlocks.available(q, v):
        raise ValueError(f"ring attention impl='flash' needs CPU tensors with equal query and value head dims "
                         f"(got {q.device.type}, {q.shape[-1]} and {v.shape[-1]}); use impl='math' or 'auto'")
    return FlashBlocks
