"""``sw.auto``'s context-parallel decision: whether the mesh's cp axis runs the model's attention as a ring.

The cp axis is the user's choice of mesh, so it is used whenever the model can run on it — no price is
compared (a cp rank computes ``1/cp`` of the tokens, as a data-parallel rank computes ``1/dp`` of the batch;
what the ring costs is ``shardwise.planner.context``'s business, which the planner's ``predict`` and ``search``
price). It can run when the traced forward (on the *full* sequence) calls ``F.scaled_dot_product_attention``,
every call without an ``attn_mask`` tensor and without dropout, and every call's sequence divides into
``2·cp`` chunks (the balanced layout). Otherwise the plan says why and the axis is searched like any other.
Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from .trace import Graph

__all__ = ["ContextDecision", "decide_context", "DROPOUT_ATTRS"]

DROPOUT_ATTRS = ("dropout", "attention_dropout", "attn_dropout", "dropout_p", "attn_pdrop")
"""Attributes an attention module keeps its dropout probability in (a float; an ``nn.Dropout`` under the two
``att`` names): the
shardwise GPT's ``dropout``, transformers' ``attention_dropout`` / ``attn_dropout``. The trace runs in eval
mode, where models pass ``dropout_p=0``, so the training dropout is read from these."""


@dataclass(frozen=True)
class ContextDecision:
    axis: str | None
    """The cp axis the plan uses (None: no context parallelism)."""
    note: str
    """The line the printed plan shows ("" when the mesh has no cp axis)."""


def _training_dropout(model: nn.Module) -> str | None:
    for name, mod in model.named_modules():
        for attr in DROPOUT_ATTRS:
            v = mod.__dict__.get(attr, mod._modules.get(attr))
            # an nn.Dropout counts under an attention name only (a residual dropout does not reach the ring)
            p = v.p if isinstance(v, nn.Dropout) and "att" in attr else v if isinstance(v, float) else None
            if p:
                return f"{name + '.' if name else ''}{attr} = {p:g}"
    return None


def decide_context(graph: Graph, model: nn.Module, axes: tuple[str, ...], shape: tuple[int, ...],
                   cp_axis: str | None) -> ContextDecision:
    """Whether (and over which axis) the plan runs attention as ring attention; see the module doc."""
    if cp_axis is None:
        return ContextDecision(None, "")
    if cp_axis not in axes:
        if cp_axis != "cp":
            raise ValueError(f"cp_axis={cp_axis!r} is not an axis of the mesh {list(axes)}; name one of them, or "
                             f"cp_axis=None for no context parallelism")
        return ContextDecision(None, "")
    cp = shape[axes.index(cp_axis)]
    if cp == 1:
        return ContextDecision(None, "")
    head = f"context parallel over {cp_axis!r} ({cp}): "
    refused = head + "refused, {}; the axis is searched like any other (data or tensor parallel)"
    calls = graph.attention
    if not calls:
        return ContextDecision(None, refused.format("the traced forward calls no scaled_dot_product_attention "
                                                    "(the call ring attention replaces)"))
    masked = sum(a.mask for a in calls)
    if masked:
        return ContextDecision(None, refused.format(
            f"{masked} of {len(calls)} scaled_dot_product_attention calls get an attn_mask tensor (the ring runs "
            f"causal or full attention without a mask: pass is_causal=True and no mask)"))
    drop = next((f"dropout_p = {a.dropout_p:g}" for a in calls if a.dropout_p > 0), None) or _training_dropout(model)
    if drop:
        return ContextDecision(None, refused.format(f"attention dropout > 0 in training ({drop}); the ring runs "
                                                    f"without dropout: set it to 0"))
    bad = sorted({a.seq for a in calls if a.seq % (2 * cp)})
    if bad:
        return ContextDecision(None, refused.format(
            f"sequence length {bad[0]} is not divisible by 2·cp = {2 * cp} (each rank holds 2 of 2·cp chunks); "
            f"use a length that is"))
    seq = calls[0].seq
    return ContextDecision(cp_axis, head + f"attention ring, sequence split 2·cp = {2 * cp} ways ({seq} tokens: "
                                          f"{seq // (2 * cp)} per chunk, 2 chunks per rank); used because the mesh "
                                          f"has the axis (not priced)")
