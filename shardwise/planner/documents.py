"""Packed documents that attend only within themselves (``data.document_mask``) as the planner prices them
(``ModelSpec.with_documents``).

A sequence of ``s`` tokens cut into documents of ``d`` tokens runs one causal attention per document: ``s/d``
blocks of ``d × d``, causal within each, instead of one causal ``s × s``. Per layer and head the scores GEMM
``(s × hd) @ (hd × keys)`` and the context GEMM ``(s × keys) @ (keys × hd)`` keep their ``s`` query rows and see
``min(keys, d)`` keys (a fused causal kernel still skips the masked half of each block: ``s·d/2`` entries).

* A sliding window of ``w`` keys (its core priced over ``window_keys(s, w)`` keys, not causal-halved): with
  ``d ≤ w`` the window no longer binds and the core is causal over ``d`` keys; with ``d > w`` it sees
  ``window_keys(d, w)`` keys. ``w`` is read back from the core's key count (``window_keys`` inverted, rounded).
* Kept activations: a fused kernel keeps one log-sum-exp per query row (unchanged); unfused attention keeps
  the ``a·s·keys`` scores (scaled by ``new keys / old keys``, ``min(1, d/s)`` for full attention) and its
  scale-mask-softmax (and dropout) traffic over them shrinks alike.
* Context parallelism (``cp_document_layers``): a cp rank's ``S/cp`` queries against their documents' keys, as
  the ring computes them — ``cp`` blocks of ``S/cp`` queries × ``keys/cp`` (the block form ``context.cp_local``
  gives a full core: the same at ``d ≥ S``); the ring still passes K/V around every hop.

``row_document_length``: the document length to price for rows of ``s`` tokens cut from a stream of documents
of mean length ``L``.
"""

from __future__ import annotations

import math
from dataclasses import replace

from .context import cp_layer
from .layers import Gemm, Layer
from .moe_builders import window_keys

__all__ = ["document_layers", "cp_document_layers", "row_document_length", "key_extent"]


def _num(x: float) -> float:
    """``x`` as an int when it is whole (GEMM extents stay ints where they can)."""
    return int(x) if float(x).is_integer() else float(x)


def key_extent(g: Gemm) -> float:
    """Keys each query of an attention core GEMM sees: ``n`` of the scores GEMM, ``k`` of the context GEMM."""
    return g.k if g.name == "context" else g.n


def _with_keys(g: Gemm, keys: float, causal: bool) -> Gemm:
    if g.name == "context":
        return replace(g, k=_num(keys), causal=causal)
    return replace(g, n=_num(keys), causal=causal)


def _document_keys(g: Gemm, s: int, d: float, flash: bool) -> tuple[float, bool]:
    """``(keys, causal)`` of attention core ``g`` (``s`` query rows) when its documents have ``d`` tokens."""
    keys = key_extent(g)
    if g.causal or keys >= s:  # full attention (causal, or unfused / traced without the causal flag)
        return min(keys, d), g.causal
    # a sliding window: keys = w - w²/(2s) (moe_builders.window_keys), so w = s - sqrt(s² - 2·s·keys)
    w = round(s - math.sqrt(max(0.0, s * s - 2.0 * s * keys)))
    if d <= w:
        return d, flash  # the window does not bind inside a document: causal over d keys
    return window_keys(max(1, round(d)), w) or keys, False


def _document_layer(layer: Layer, s: int, d: float, flash: bool, traffic_per_kept: float) -> Layer:
    """``layer`` with its attention cores over documents of ``d`` tokens (module doc)."""
    cores = [g for g in layer.gemms if not g.weight]
    if not cores:
        return layer
    out, ratio = [], 1.0
    for g in layer.gemms:
        if g.weight:
            out.append(g)
            continue
        keys, causal = _document_keys(g, s, d, flash)
        ratio = keys / key_extent(g)
        out.append(_with_keys(g, keys, causal))
    if flash:  # a fused kernel keeps O(s) statistics per row: nothing of O(s²) to shrink
        return replace(layer, gemms=tuple(out))
    # unfused: the a·s·keys kept scores and the softmax (dropout) passes over them shrink with the keys
    cut = (1.0 - ratio) * layer.act_attn
    return replace(layer, gemms=tuple(out), act_attn=layer.act_attn - cut,
                   ew_tp=max(0.0, layer.ew_tp - traffic_per_kept * cut))


def document_layers(layers: tuple[Layer, ...], *, seq_len: int, doc_len: float, flash: bool,
                    dropout: bool = False) -> tuple[Layer, ...]:
    """Every layer with its attention over documents of ``doc_len`` tokens (module doc). ``dropout``: the
    unfused cores drop out their scores (traffic 4.5 elements per 2.5 kept, ``builders._attention_core``),
    else 2 per 1."""
    traffic = 4.5 / 2.5 if dropout else 2.0
    return tuple(_document_layer(layer, seq_len, doc_len, flash, traffic) for layer in layers)


def cp_document_layers(layers: tuple[Layer, ...], cp: int) -> tuple[Layer, ...]:
    """Layers of a documents spec (``document_layers``) as one of ``cp`` ranks runs them: ``context.cp_layer``
    for everything but the cores, each core as ``cp`` blocks of ``rows/cp`` queries × ``keys/cp`` keys."""
    out = []
    for layer in layers:
        local = cp_layer(layer, cp)
        cores = iter(_with_keys(replace(g, rows=g.rows // cp, batch=g.batch * cp), key_extent(g) / cp, g.causal)
                     for g in layer.gemms if not g.weight)
        out.append(replace(local, gemms=tuple(g if g.weight else next(cores) for g in local.gemms)))
    return tuple(out)


def row_document_length(mean_doc: float, seq_len: int) -> float:
    """The document length to price for rows of ``seq_len`` tokens cut from a stream of documents of mean length
    ``mean_doc`` (``L``): a row begins and ends inside documents, whose cut parts attend as documents of their
    own. For documents all of length ``L`` at a uniform offset into the row, the expected ``Σ d² / s`` of the
    row's pieces (two tokens ``δ`` apart share a piece with probability ``max(0, 1 - δ/L)``) is
    ``L - L²/(3s)`` for ``L ≤ s`` and ``s - s²/(3L)`` above; a causal attention costs ``Σ d²/2 = s·that/2``.
    Lengths that vary make ``Σ d² / Σ d`` larger than the mean: this underestimates their attention."""
    if not mean_doc > 0 or seq_len < 1:
        raise ValueError(f"row_document_length needs a positive mean document length and seq_len, got {mean_doc!r} "
                         f"and {seq_len!r}")
    L, s = float(mean_doc), float(seq_len)
    return L - L * L / (3.0 * s) if L <= s else s - s * s / (3.0 * L)
