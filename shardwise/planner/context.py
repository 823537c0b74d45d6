"""Context parallelism (ring attention) as the planner costs it: what one of ``cp`` ranks computes, keeps and
sends.

Each sequence of ``S`` tokens is cut into ``2·cp`` chunks and cp rank ``i`` holds chunks ``i`` and
``2·cp − 1 − i`` (causal load balance: every rank does the same attention work). Everything outside the
attention core — embeddings, the weight GEMMs, norms, elementwise kernels, the head and the loss — runs on
``S/cp`` tokens; the attention core's queries are the rank's ``S/cp`` tokens against all ``S`` keys, of which
the causal half counts: ``S²/(2·cp)`` score entries per head per rank, the total ``S²/2`` split evenly
(``cp_local``: the same ``Layer`` rows with every per-token quantity divided by cp, and each attention GEMM
as the ``cp`` blocks of ``S/cp × S/cp`` the ring computes one per step — a batch of cp, so that small blocks
pay their lower GEMM efficiency).

The ring (``ring_times``): in forward a rank passes its K/V block — ``b · S/cp · 2 · hkv·hd / tp`` elements of
the key/value heads (grouped-query attention sends ``hkv`` heads) — to its neighbour ``cp − 1`` times, each hop
overlapped with the attention of the block it already holds (``1/cp`` of the rank's attention core); backward
passes K/V again (``cp − 1`` hops) and the dK/dV accumulators (``cp`` hops, in fp32), overlapped with the block's
attention backward. Exposed per hop: ``max(0, hop − block compute)``, plus one hop latency that nothing
hides. Recomputation (full or selective) runs the forward ring again in backward. Each step after the first
also merges its partial attention output into the running one (memory-bound: three passes over the rank's
``S/cp × h`` output, one more launch for the step's kernel and one for the merge).

The cp group is ``cp`` ranks ``tp`` apart (the mesh ``(pp, dp, cp, tp)``, row-major): inside a node when
``tp · cp ≤ devices_per_node``, else each hop crosses nodes on the device's NIC share.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from .compute import LayerTime, act_bytes, attention_time
from .hardware import Hardware
from .layers import Gemm, Layer
from .plan import Layout

__all__ = ["cp_local", "cp_layer", "kv_width", "ring_times", "cp_crosses_nodes", "local_spec", "with_ring"]


def cp_layer(layer: Layer, cp: int) -> Layer:
    """``layer`` as one of ``cp`` ranks runs it (module doc): per-token work, activations and traffic / cp; the
    attention core as ``cp`` blocks of ``S/cp`` queries against ``S/cp`` keys; parameters unchanged."""
    if cp == 1:
        return layer
    gemms = tuple(replace(g, rows=g.rows // cp) if g.weight else _ring_blocks(g, cp) for g in layer.gemms)
    # each ring step after the first merges its partial output into the running one (rescaled by the log-sum-exp
    # statistics): read two outputs, write one, of the rank's S/cp queries × all query heads, one launch more for
    # the step's attention kernel and one for the merge (backward: twice, as every elementwise pass)
    scores = next((g for g in layer.gemms if not g.weight and g.name != "context"), None)
    merge = 3.0 * (cp - 1) * (scores.rows // cp) * scores.batch * scores.k if scores else 0.0
    return replace(layer, gemms=gemms, ew_rep=layer.ew_rep / cp, ew_tp=layer.ew_tp / cp + merge,
                   ops=layer.ops + (2 * (cp - 1) if scores else 0), act_rep=layer.act_rep / cp,
                   act_tp=layer.act_tp / cp, act_attn=layer.act_attn / cp, act_fp32=layer.act_fp32 / cp,
                   hidden=layer.hidden // cp, a2a=layer.a2a / cp)


def _ring_blocks(g: Gemm, cp: int) -> Gemm:
    """An attention-core GEMM of ``S`` queries against ``S`` keys as one cp rank runs it: ``cp`` blocks of its
    ``S/cp`` queries against ``S/cp`` keys (one per ring step, each a kernel of that size), as a batch."""
    if g.name == "context" or (g.name != "scores" and g.k == g.rows != g.n):  # (S × S) @ (S × hd)
        return replace(g, rows=g.rows // cp, k=g.k // cp, batch=g.batch * cp)
    if g.n == g.rows:  # scores: (S × hd) @ (hd × S)
        return replace(g, rows=g.rows // cp, n=g.n // cp, batch=g.batch * cp)
    return replace(g, rows=g.rows // cp)


def cp_local(layers: tuple[Layer, ...], cp: int) -> tuple[Layer, ...]:
    """Every layer of a model as one of ``cp`` context-parallel ranks runs it."""
    return layers if cp == 1 else tuple(cp_layer(layer, cp) for layer in layers)


def kv_width(layer: Layer, kv_heads: int, hidden: int, heads: int, cp: int = 1) -> int:
    """Elements per token of one of K or V (``hkv · hd``): the model's kv heads where the spec names them,
    else the attention core's query heads (multi-head attention; a cp rank's ``layer`` batches its cp blocks);
    0 for a layer without attention."""
    core = next((g for g in layer.gemms if not g.weight), None)
    if core is None:
        return 0
    hd = core.k if core.name != "context" else core.n
    if kv_heads and heads and hidden:
        return kv_heads * (hidden // heads)
    return core.batch // cp * hd


def cp_crosses_nodes(tp: int, cp: int, devices_per_node: int) -> bool:
    """Whether the cp group's neighbours sit on different nodes (cp placed outside tp, inside dp)."""
    return tp * cp > devices_per_node


def ring_times(*, kv_elements: float, elem_bytes: int, cp: int, tp: int, attn_fwd_s: float, attn_bwd_s: float,
               hw: Hardware, grad_bytes: int = 4) -> tuple[float, float]:
    """``(exposed forward seconds, exposed backward seconds)`` of one layer's ring for one micro-batch.

    ``kv_elements``: K and V of the rank's ``S/cp`` tokens and ``b`` sequences, all kv heads (``b · S/cp · 2 ·
    hkv·hd``); a tensor-parallel rank sends its ``1/tp`` of them. ``attn_fwd_s`` / ``attn_bwd_s``: the rank's
    whole attention core forward / backward (the ``cp`` blocks together). K/V travel in the compute precision
    (``elem_bytes``), the dK/dV accumulators in fp32 (``grad_bytes``), as ``sw.context_parallel`` sends them."""
    if cp <= 1 or kv_elements <= 0:
        return 0.0, 0.0
    nbytes = kv_elements / tp * elem_bytes
    cross = cp_crosses_nodes(tp, cp, hw.devices_per_node)
    hop = hw.p2p_time(nbytes, cross_node=cross)
    block_f, block_b = attn_fwd_s / cp, attn_bwd_s / cp
    first = hw.p2p_alpha_s  # the first hop's latency: no block is under way to hide it
    fwd = first + (cp - 1) * max(0.0, hop - block_f)
    # backward: cp − 1 steps send K/V (for the next block) and dK/dV together, the last step dK/dV alone
    grads = kv_elements / tp * grad_bytes
    both = hw.p2p_time(nbytes + grads, cross_node=cross)
    last = hw.p2p_time(grads, cross_node=cross)
    bwd = first + (cp - 1) * max(0.0, both - block_b) + max(0.0, last - block_b)
    return fwd, bwd


def local_spec(spec: Any, plan: Layout, cache: dict | None = None) -> Any:
    """``spec`` as one of the plan's ``cp`` ranks runs it (``ModelSpec.for_cp``; itself at cp = 1), memoised in
    ``cache`` (which keeps it alive, so that memo keys by ``id`` stay unique)."""
    if plan.cp == 1:
        return spec
    if not any(not g.weight for layer in spec.layers for g in layer.gemms):
        raise ValueError(f"cp = {plan.cp}: model {spec.name!r} has no attention core the planner can split over "
                         f"a ring; use cp = 1")
    key = ("cp spec", id(spec), plan.cp)
    if cache is not None and key in cache:
        return cache[key][1]
    out = spec.for_cp(plan.cp)
    if cache is not None:
        cache[key] = (spec, out)
    return out


def with_ring(spec: Any, layer: Any, t: LayerTime, plan: Layout, hw: Hardware, flash: bool) -> LayerTime:
    """``t`` with the exposed ring-attention communication of context parallelism added to F and B
    (``context.ring_times``); a recomputed forward (full or selective) runs its ring again in backward."""
    if spec.meta.get("cp", 1) != plan.cp:
        raise ValueError(f"layer costs at cp = {plan.cp} need the cp rank's view of the model: "
                         f"spec.for_cp({plan.cp})")
    width = kv_width(layer, spec.kv_heads, spec.hidden, spec.heads, plan.cp)
    if not width:
        return t
    rows = next(g.rows for g in layer.gemms if not g.weight)  # the rank's S/cp query tokens
    attn_f, attn_b = attention_time(layer, plan, hw, flash=flash)
    fwd, bwd = ring_times(kv_elements=plan.micro_batch * rows * 2.0 * width, elem_bytes=act_bytes(plan),
                          cp=plan.cp, tp=plan.tp, attn_fwd_s=attn_f, attn_bwd_s=attn_b, hw=hw)
    if layer.kind == "block" and plan.activation_checkpointing in ("full", "selective"):
        bwd += fwd
    return replace(t, F=t.F + fwd, B=t.B + bwd, cp_fwd=fwd, cp_bwd=bwd)
