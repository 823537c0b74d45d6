"""``sw.generate``: sample text tokens from a causal language model on one device, with a key/value cache.

The prompt runs through the model once (prefill, ``model.decode`` with an empty ``KVCache``); then every step
picks one token from the last position's logits and feeds only that token, attending to the cached keys and
values of all earlier positions. A model without ``decode`` (any module mapping (b, t) token ids to (b, t, v)
logits) is decoded by a full forward of the whole sequence per step — the same tokens, slower.

Picking a token: ``temperature`` 0 is greedy (``argmax``, the first of equal maxima, as ``transformers`` does);
otherwise the logits are divided by ``temperature``, all but the ``top_k`` largest dropped (``top_k`` 0: none
dropped) and one token drawn from the softmax with ``generator`` (a seeded ``torch.Generator`` on the model's
device makes the draw reproducible). Shapes: ``b`` rows, ``t`` prompt length, ``n`` new tokens, ``v`` vocabulary.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from .kv_cache import KVCache

__all__ = ["generate", "check_request", "context_length", "vocab_size", "pick_token"]


def context_length(model: nn.Module) -> int | None:
    """The most positions ``model`` attends over: the reference GPT's ``block_size`` (rows of its position
    table), the Llama-family decoder's ``block_size`` (what it was built with); None when the model does not say."""
    config = getattr(model, "config", None)
    if isinstance(getattr(model, "block_size", None), int):
        return int(model.block_size)  # type: ignore[arg-type]
    if isinstance(getattr(config, "block_size", None), int):
        return int(config.block_size)  # type: ignore[union-attr]
    return None


def vocab_size(model: nn.Module) -> int | None:
    """Rows of the model's output head (the ids it can read and write); None when the model does not say."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    return int(size) if isinstance(size, int) else None


def check_request(model: nn.Module, ids: Tensor, max_new_tokens: int, temperature: float, top_k: int) -> None:
    """One-line ``ValueError``/``TypeError`` for a bad argument of ``generate`` (``ids`` (b, t)), before any
    computation; reads the model's config only (a meta-device model will do)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"generate expects an nn.Module language model, got {type(model).__name__}")
    if ids.dtype not in (torch.int64, torch.int32) or ids.dim() != 2 or ids.size(1) == 0:
        raise ValueError(f"prompt_ids must be a non-empty (t,) or (b, t) integer tensor of token ids, got "
                         f"{tuple(ids.shape)} {ids.dtype}; encode the prompt first")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens!r} must be an int >= 1, e.g. max_new_tokens=100")
    if not temperature >= 0:
        raise ValueError(f"temperature = {temperature!r} must be >= 0 (0: greedy, 1: the model's distribution)")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k = {top_k!r} must be an int >= 0 (0: no top-k filtering)")
    vocab = vocab_size(model)
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab is not None and high >= vocab):
        bad = low if low < 0 else high
        raise ValueError(f"prompt token id {bad} is outside the model's vocabulary [0, {vocab}); encode the prompt "
                         f"with the model's own tokenizer")
    limit, t = context_length(model), ids.size(1)
    if limit is not None and t >= limit:
        raise ValueError(f"the prompt ({t} tokens) leaves no room in the model's context of {limit} positions "
                         f"(block_size / max_position_embeddings); shorten it to at most {limit - 1} tokens")
    if limit is not None and t + max_new_tokens > limit:
        raise ValueError(f"prompt ({t} tokens) + max_new_tokens ({max_new_tokens}) = {t + max_new_tokens} exceeds "
                         f"the model's context of {limit} positions (block_size / max_position_embeddings); ask for "
                         f"at most {limit - t} new tokens or shorten the prompt")


def pick_token(logits: Tensor, temperature: float, top_k: int, generator: torch.Generator | None = None) -> Tensor:
    """One token per row of ``logits`` (b, v) → (b,) int64: greedy for ``temperature`` 0, else a draw from
    softmax(logits / temperature) over the ``top_k`` largest (all for 0)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.size(-1):
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]  # (b, 1): the k-th largest per row
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: Tensor, max_new_tokens: int = 100, temperature: float = 1.0,
             top_k: int = 0, generator: torch.Generator | None = None, *,
             eos_token_id: int | Sequence[int] | None = None, use_cache: bool = True) -> Tensor:
    """``prompt_ids`` (t,) or (b, t) followed by up to ``max_new_tokens`` sampled tokens: (t + n,) or (b, t + n)
    on the prompt's device (put ``model`` and ``prompt_ids`` on one device). ``temperature`` 0 is greedy; ``top_k``
    0 keeps the whole vocabulary; ``generator`` seeds the draws. A row that produced an ``eos_token_id`` is
    finished (the token is kept) and padded with the first EOS id until every row is; generation stops when all
    rows are finished or after ``max_new_tokens``. ``use_cache`` False runs a full forward per step (the
    reference the cache is tested against). The model is put in eval mode. ``ValueError`` (one line) for an empty
    prompt, a token id outside the vocabulary, ``max_new_tokens`` < 1, ``temperature`` < 0, ``top_k`` < 0, or a
    prompt + new tokens longer than the model's context (``block_size``)."""
    ids = prompt_ids.unsqueeze(0) if prompt_ids.dim() == 1 else prompt_ids
    check_request(model, ids, max_new_tokens, temperature, top_k)
    ids = ids.to(torch.int64)
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    eos_t = torch.tensor(eos, dtype=torch.int64, device=ids.device)
    model.eval()
    cache = KVCache(ids.size(1) + max_new_tokens) if use_cache and callable(getattr(model, "decode", None)) else None
    logits = (model.decode(ids, cache) if cache is not None else model(ids))[:, -1]  # (b, v)
    done = torch.zeros(ids.size(0), dtype=torch.bool, device=ids.device)
    new: list[Tensor] = []
    for step in range(max_new_tokens):
        token = pick_token(logits, temperature, top_k, generator)  # (b,)
        if eos:
            token = torch.where(done, eos_t[0], token)
            done = done | torch.isin(token, eos_t)
        new.append(token)
        if step == max_new_tokens - 1 or (eos and bool(done.all())):
            break
        if cache is not None:
            logits = model.decode(token[:, None], cache)[:, -1]
        else:
            logits = model(torch.cat([ids, torch.stack(new, dim=1)], dim=1))[:, -1]
    out = torch.cat([ids, torch.stack(new, dim=1)], dim=1)
    return out[0] if prompt_ids.dim() == 1 else out
