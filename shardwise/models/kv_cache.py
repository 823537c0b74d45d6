"""A key/value cache for decoding one token at a time, shared by the reference GPT and the Llama-family decoder.

Decoding without a cache runs the whole sequence through the model for every new token: step ``i`` recomputes
the keys and values of all ``t + i`` positions although only the newest one changed. With a cache the prompt is
run once (prefill) and each later step feeds one token, whose query attends to the cached keys and values of
every earlier position (``GPT.decode``, ``Llama.decode``). The numbers are those of the full forward up to float
rounding: the same projections of the same inputs, and a causal mask shifted by the cache's length.

Shapes: ``b`` batch, ``nkv`` key/value heads (``nh`` for the GPT), ``t`` new positions, ``hd`` head width,
``c`` capacity (prompt + new tokens). Buffers are allocated on the first write of each layer, so the cache needs
to know nothing about the model but how many positions it will hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["KVCache", "cached_attention"]


class KVCache:
    """Per layer, the keys and values of every position seen so far, in (b, nkv, c, hd) buffers filled left to
    right. A model's ``decode`` appends each layer's new keys/values (``append``) and then ``advance`` s the length
    once for all layers."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"KVCache capacity must be a positive int (prompt + new tokens), got {capacity!r}")
        self.capacity = capacity
        self.length = 0
        """Positions cached so far: the next token's position."""
        self._keys: dict[int, Tensor] = {}
        self._values: dict[int, Tensor] = {}

    def append(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store ``k``, ``v`` (b, nkv, t, hd) of ``layer`` at positions ``length .. length + t - 1``; returns the
        layer's keys and values of all positions so far, (b, nkv, length + t, hd) views of the buffers — or ``k``,
        ``v`` themselves when the cache was empty, so that a prefill attends to exactly the training forward's
        tensors."""
        start, end = self.length, self.length + k.size(2)
        if end > self.capacity:
            raise ValueError(f"KVCache holds {self.capacity} positions, {start} are used and {k.size(2)} more were "
                             f"given; create the cache with capacity >= prompt + new tokens")
        if layer not in self._keys:
            shape = (k.size(0), k.size(1), self.capacity, k.size(3))
            self._keys[layer] = torch.empty(shape, dtype=k.dtype, device=k.device)
            self._values[layer] = torch.empty(shape, dtype=v.dtype, device=v.device)
        keys, values = self._keys[layer], self._values[layer]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        if start == 0:
            return k, v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, t: int) -> None:
        """Count ``t`` more positions as cached (once per model call, after every layer appended)."""
        self.length += t


def cached_attention(q: Tensor, k: Tensor, v: Tensor, past: int) -> Tensor:
    """Causal attention of ``q`` (b, nh, t, hd) at positions ``past .. past + t - 1`` over ``k``, ``v`` (b, nh,
    past + t, hd): query ``i`` sees keys ``0 .. past + i``. → (b, nh, t, hd). One new token (t = 1) sees every
    key, so it needs no mask; a prompt with an empty cache (past = 0) is the training forward's causal case."""
    t = q.size(2)
    if past == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if t == 1:
        return F.scaled_dot_product_attention(q, k, v)
    # (t, past + t) boolean mask, True where attention is allowed: the causal triangle shifted right by ``past``
    mask = torch.ones(t, past + t, dtype=torch.bool, device=q.device).tril(diagonal=past)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
