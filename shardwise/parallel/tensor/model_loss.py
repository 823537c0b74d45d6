"""A model's own loss under a vocabulary-parallel LM head.

A Hugging Face causal LM computes ``model(ids, labels=ids).loss`` itself, through ``self.loss_function(logits,
labels, vocab_size=V, ...)`` (``transformers``' ``ForCausalLMLoss``: shift the labels left by one, pad with
``ignore_index``, flatten, ``cross_entropy``). Under ``VocabParallel`` on the head the logits it hands over are this
rank's slice ``(b, t, v_r)``, and the stock loss would reshape them with the full ``V`` (a batch-size mismatch
error). ``install_model_loss`` replaces the model's ``loss_function`` (the instance attribute the property reads)
by the same computation on the sharded logits: the same shift and ``ignore_index``, ``num_items_in_batch``
(sum, then divide) or mean, and ``vocab_parallel_cross_entropy`` in place of ``cross_entropy``.

Why the vocabulary-parallel loss rather than gathering the logits: the gather moves ``(b·t, V)`` values per step
in forward (and keeps full logits on every rank); the split loss moves three ``(b·t,)`` vectors — for any
vocabulary larger than a handful of tokens it is the cheaper choice, so it is the only one offered.

A model whose ``forward`` takes ``labels`` but computes its loss some other way (no ``loss_function``) cannot be
reached: calling it with ``labels`` raises a one-line ``ValueError`` with the fix before the model runs.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch
import torch.nn as nn

from .modules import TPContext
from .vocab_loss import vocab_parallel_cross_entropy

__all__ = ["install_model_loss"]


def _causal_lm_loss(ctx: TPContext) -> Callable[..., torch.Tensor]:
    """``ForCausalLMLoss`` on vocabulary-split logits ``(b, t, v_r)``; labels ``(b, t)`` full token ids."""

    def loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
             num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
             shift_labels: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        if shift_labels is None:
            # position i predicts token i+1; the last position has no target (ignore_index)
            padded = nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        reduction = "mean" if num_items_in_batch is None else "sum"
        out = vocab_parallel_cross_entropy(logits.float(), shift_labels, mesh=ctx.mesh, axis=ctx.axis,
                                           vocab_size=vocab_size, ignore_index=ignore_index, reduction=reduction,
                                           algorithm=ctx.algorithm)
        if num_items_in_batch is not None:
            out = out / (num_items_in_batch.to(out.device) if torch.is_tensor(num_items_in_batch)
                         else num_items_in_batch)
        return out
    return loss


def _takes_labels(model: nn.Module) -> bool:
    try:
        return "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def install_model_loss(model: nn.Module, head: str, ctx: TPContext) -> None:
    """Make ``model``'s own loss right when ``head`` (a module name) is a vocabulary-parallel ``nn.Linear``:
    the nearest Hugging Face model holding the head (``model`` itself or a submodule with ``loss_function``) gets
    the vocabulary-parallel causal-LM loss; else, when ``model.forward`` takes ``labels``, a forward pre-hook
    refuses ``labels``. Local."""
    parts = head.split(".")
    for depth in range(len(parts) - 1, -1, -1):  # the nearest module above the head that owns a loss_function
        owner = model.get_submodule(".".join(parts[:depth]))
        if hasattr(type(owner), "loss_function"):
            owner.loss_function = _causal_lm_loss(ctx)  # the property's setter: an instance override
            return
    if not _takes_labels(model):
        return  # the model returns logits only: the caller computes the loss (vocab_parallel_cross_entropy)

    def refuse(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("labels") is not None:
            raise ValueError(f"{type(model).__name__} computes its loss from labels without a loss_function "
                             f"that sw.parallelize can replace, and its head {head!r} is vocabulary-parallel "
                             f"(logits (b, t, V/tp)); call it without labels and compute the loss with "
                             f"vocab_parallel_cross_entropy, or keep {head!r} replicated (leave it out of the "
                             f"plan, or sw.auto pins={{{head!r}: 'B'}})")
    model.register_forward_pre_hook(refuse, with_kwargs=True)
