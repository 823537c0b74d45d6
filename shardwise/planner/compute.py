"""Time of one micro-batch through one layer on one tensor-parallel group: forward ``F``, input gradient ``B``,
weight gradient ``W`` and the recomputation that activation checkpointing adds to backward.

GEMMs cost ``Hardware.gemm_time`` at their tensor-parallel shape; memory-bound kernels cost their traffic at
the memory bandwidth. Backward of a weight GEMM is two GEMMs of the same FLOPs (input and weight gradient,
Narayanan et al. 2021 App.; Qi et al. 2023 Table 1: ``B ≈ W ≈ F`` per GEMM); the attention core has no
weight and a backward of twice its forward. Memory-bound backward moves twice the forward traffic.
The exposed tensor-parallel all-reduces (Megatron's ``f``/``g`` pair: two per block in forward, two in backward,
none overlapped with compute) are returned separately so the breakdown can name them; with ``Layout.async_tp``
they are cut into pieces under the matmuls and cost what ``tp_overlap`` says stays exposed.

The attention core, two ways. Unfused (``ModelSpec.attention = "unfused"``, the kernels of Megatron-LM 2021
and Korthikanti 2022: the scores go through memory) and a fused kernel on CPU ranks: its two GEMMs at their
roofline, the ``s × s`` scores among their operands. A fused kernel on a GPU (``flash``; ``io_aware_attention``):
one IO-aware kernel whose traffic is ``O(s·h)`` (``_fused_core``), so long sequences stay compute-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .hardware import Hardware
from .kernels import attention_efficiency
from .plan import Layout
from .layers import Gemm, Layer
from .moe import moe_comm
from .tp_overlap import GemmChunks, OverlapTime, layer_overlap, overlap_share

__all__ = ["LayerTime", "layer_time", "act_bytes", "param_bytes", "attention_time", "io_aware_attention",
           "async_tp_times"]


def act_bytes(plan: Layout) -> int:
    """Bytes of one kept activation element under the plan's compute precision."""
    return 4 if plan.precision == "fp32" else 2


def param_bytes(plan: Layout) -> int:
    """Bytes of one weight element as the GEMMs read it (bf16 autocast casts fp32 weights to 2 bytes)."""
    return 4 if plan.precision == "fp32" else 2


@dataclass(frozen=True)
class LayerTime:
    """Seconds for one micro-batch; ``tp_*`` are the exposed tensor-parallel collectives inside F and B."""

    F: float
    B: float
    W: float
    recompute: float
    tp_fwd: float
    tp_bwd: float
    flops_fwd: float
    """Forward GEMM FLOPs of the micro-batch on this device (attention counted in full, Megatron's way)."""
    flops_attn: float
    """Of which the attention core (what selective recomputation repeats)."""
    cp_fwd: float = 0.0
    """Exposed ring-attention communication inside F (context parallelism; ``context.ring_times``)."""
    cp_bwd: float = 0.0
    """... inside B (the recomputed forward's ring included)."""
    ep_fwd: float = 0.0
    """Expert-parallel all-to-alls inside F (``moe.moe_comm``; ``Layout.ep > 1``)."""
    ep_bwd: float = 0.0
    """... inside B (a fully recomputed forward's included)."""


def _shape(g: Gemm, b: int, t: int, ep: int = 1) -> tuple[float, float, float, float]:
    """``(m, n, k, batch)`` of gemm ``g`` for ``b`` sequences on one of ``t`` tensor-parallel ranks (and of ``ep``
    expert-parallel ones: a grouped expert GEMM is ``E/ep`` experts of ``rows · b · ep / E`` rows each)."""
    m, n, k, batch = float(g.rows * b), float(g.n), float(g.k), float(g.batch)
    if g.experts:
        m, batch = m * ep / g.experts, batch * g.experts / ep
    if g.split == "col":
        n /= t
    elif g.split == "row":
        k /= t
    elif g.split == "heads":
        batch /= t
    return m, n, k, batch


def io_aware_attention(flash: bool, hw: Hardware) -> bool:
    """Whether the attention core is priced as an IO-aware fused kernel (module doc): a ``flash`` spec on a
    GPU (``F.scaled_dot_product_attention``'s flash / memory-efficient kernels on CUDA, FlashAttention in the
    2024 published runs). CPU ranks keep the per-GEMM roofline their calibrations were compared under."""
    return flash and hw.kind == "gpu"


def _fused_core(cores: list[tuple[Gemm, float, float, float, float]], hw: Hardware, dtype: str, eb: int,
                ) -> tuple[float, float]:
    """``(forward, backward)`` seconds of the attention cores ``cores`` (``(gemm, m, n, k, batch)`` at the rank's
    shape) as IO-aware fused kernels, the causal half skipped. FLOPs in the FlashAttention papers' convention
    (``kernels`` module doc): forward the two tile products, backward 2.5× them (it recomputes the scores: five
    tile products to two). Their rate: the device's published kernel throughput by head dimension, keys per
    sequence, mask and direction (``Hardware.attention_table``, bf16), else the GEMM efficiency of the per-head
    products both ways. Memory traffic ``O(s·h)`` — Q, K (with the scores GEMM), V, O (with the context GEMM)
    once per block pass and the fp32 log-sum-exp per query row — never the ``s × s`` scores; backward moves
    twice that (Q, K, V, O, dO read; dQ, dK, dV written). One launch forward; two backward (the dO·O row sums,
    the main kernel)."""
    fwd = bwd = io = 0.0
    kernels = 0
    table = bool(hw.attention_table) and dtype == "bf16"
    for g, m, n, k, batch in cores:
        flops = 2.0 * m * n * k * batch * (0.5 if g.causal else 1.0)
        peak = hw.peak_flops[dtype]
        if table:
            # scores: (queries × hd) @ (hd × keys); context: (queries × keys) @ (keys × hd)
            hd, keys = (n, k) if g.name == "context" else (k, n)
            fwd += flops / (peak * attention_efficiency(hw, hd, keys, g.causal, "fwd"))
            bwd += 2.5 * flops / (peak * attention_efficiency(hw, hd, keys, g.causal, "bwd"))
        else:
            one = flops / (peak * hw.gemm_efficiency(m, n, k, dtype))
            fwd, bwd = fwd + one, bwd + 2.5 * one
        if g.name == "context":  # (s × keys) @ (keys × hd): V read, O written
            io += eb * (k * n + m * n) * batch
        else:  # scores (s × hd) @ (hd × keys): Q, K read, the log-sum-exp written
            io += eb * (m * k + k * n) * batch + 4.0 * m * batch
            kernels += 1
    return hw.kernel_time(fwd, io, kernels), hw.kernel_time(bwd, 2.0 * io, 2 * kernels)


def _gemms(layer: Layer, plan: Layout, hw: Hardware, flash: bool) -> tuple[float, float, float, float, float, float]:
    """Forward, input-gradient and weight-gradient GEMM seconds, the attention core's share of forward,
    and the FLOPs (all, attention)."""
    dtype = "fp32" if plan.precision == "fp32" else "bf16"
    eb = param_bytes(plan)
    f = bw = ww = attn = flops = attn_flops = 0.0
    fused = io_aware_attention(flash, hw)
    cores: list[tuple[Gemm, float, float, float, float]] = []
    for g in layer.gemms:
        m, n, k, batch = _shape(g, plan.micro_batch, plan.tp, plan.ep)
        full_flops = 2.0 * m * n * k * batch
        flops += full_flops
        if g.experts and plan.ep > 1 and layer.imbalance != 1.0:
            # the most loaded expert-parallel rank's rows set the pace (``moe`` module doc); FLOPs stay the mean
            m *= layer.imbalance
        if not g.weight and fused:
            cores.append((g, m, n, k, batch))
            attn_flops += full_flops
            continue
        fwd = hw.gemm_time(m, n, k, dtype=dtype, batch=batch, elem_bytes=eb)
        if not g.weight:
            # a fused causal kernel skips the masked half (both ways); its backward recomputes the scores
            scale = 0.5 if (g.causal and flash) else 1.0
            fwd = hw.gemm_time(m, n, k, dtype=dtype, batch=batch * scale, elem_bytes=eb)
            f += fwd
            attn += fwd
            attn_flops += full_flops
            bw += (2.5 if flash else 2.0) * fwd
            continue
        f += fwd
        bw += hw.gemm_time(m, k, n, dtype=dtype, batch=batch, elem_bytes=eb)
        ww += hw.gemm_time(k, n, m, dtype=dtype, batch=batch, elem_bytes=eb)
    if cores:
        core_f, core_b = _fused_core(cores, hw, dtype, eb)
        f, attn, bw = f + core_f, attn + core_f, bw + core_b
    return f, bw, ww, attn, flops, attn_flops


def attention_time(layer: Layer, plan: Layout, hw: Hardware, *, flash: bool) -> tuple[float, float]:
    """``(forward, backward)`` seconds of ``layer``'s attention core for one micro-batch on one rank (what a
    ring-attention hop hides under, ``cp`` blocks of it together)."""
    core = replace(layer, gemms=tuple(g for g in layer.gemms if not g.weight))
    if not core.gemms:
        return 0.0, 0.0
    f, b, _, _, _, _ = _gemms(core, plan, hw, flash)
    return f * hw.fwd_factor, b * hw.bwd_factor


def layer_time(layer: Layer, plan: Layout, hw: Hardware, *, flash: bool, tp_per_node: int) -> LayerTime:
    """Times of ``layer`` for one micro-batch of ``plan.micro_batch`` sequences (see module doc)."""
    if hw.host_launch_s > 0:
        # a GPU fed by an eager host: each phase lasts the longer of the device's work and the host's launches
        # (the host queues ahead while long GEMMs run, so the maximum is over the phase, not per kernel)
        device = _layer_time(layer, plan, replace(hw, host_launch_s=0.0), flash, tp_per_node)
        # launches per phase: the phase's time is linear in the per-launch cost (factors 1: a launch is one)
        bare = replace(hw, host_launch_s=0.0, op_overhead_s=0.0, fwd_factor=1.0, bwd_factor=1.0, recompute_factor=1.0)
        t0 = _layer_time(layer, plan, bare, flash, tp_per_node)
        t1 = _layer_time(layer, plan, replace(bare, op_overhead_s=1.0), flash, tp_per_node)
        host = hw.host_launch_s * (hw.autocast_launch_factor if plan.precision == "bf16" else 1.0)
        return replace(device, F=max(device.F, (t1.F - t0.F) * host), B=max(device.B, (t1.B - t0.B) * host),
                       W=max(device.W, (t1.W - t0.W) * host))
    return _layer_time(layer, plan, hw, flash, tp_per_node)


def _layer_time(layer: Layer, plan: Layout, hw: Hardware, flash: bool, tp_per_node: int) -> LayerTime:
    if layer.replicated and plan.tp > 1:
        # every tp rank runs the whole layer; its FLOPs count once for the model (per device: 1/tp of them)
        whole = layer_time(layer, replace(plan, tp=1, sequence_parallel=False), hw, flash=flash, tp_per_node=1)
        return replace(whole, flops_fwd=whole.flops_fwd / plan.tp, flops_attn=whole.flops_attn / plan.tp)
    t, b = plan.tp, plan.micro_batch
    f_gemm, b_gemm, w_gemm, f_attn, flops, attn_flops = _gemms(layer, plan, hw, flash)
    rep = layer.ew_rep / (t if plan.sequence_parallel else 1)
    ew_bytes = (rep + layer.ew_tp / t) * b * act_bytes(plan)
    f_ew = hw.memory_time(ew_bytes, layer.ops)
    b_ew = hw.memory_time(2 * ew_bytes, 2 * layer.ops)
    tp_one = 0.0
    if t > 1 and layer.tp_allreduces:
        nbytes = layer.hidden * b * act_bytes(plan)
        one = hw.collective_time("all_reduce", nbytes, t, per_node=tp_per_node, algorithm="native") + hw.sync_skew_s
        tp_one = layer.tp_allreduces * one
    tp_f = tp_b = tp_one
    if t > 1 and layer.tp_allreduces and plan.async_tp:
        # each collective still waits for the slowest rank once (the sync skew), as unoverlapped
        over_f, over_b = async_tp_times(layer, plan, hw, tp_per_node)
        skew = layer.tp_allreduces * hw.sync_skew_s
        tp_f, tp_b = over_f.total + skew, over_b.total + skew
    # the calibration's block probe corrects what kernel costs alone miss (1.0 without a probe); it timed a
    # block without communication, so the tensor-parallel all-reduces are added after it
    compute_f = (f_gemm + f_ew) * hw.fwd_factor
    F = compute_f + tp_f
    recompute = 0.0
    if plan.activation_checkpointing == "full" and layer.kind == "block":
        # the forward once more, its all-reduces included; a calibrated host says what the recomputed compute
        # really adds (``recompute_factor``: 1 on the presets)
        recompute = compute_f * hw.recompute_factor + tp_f
    elif plan.activation_checkpointing == "selective" and layer.kind == "block":
        # everything but the weight GEMMs (parallel/common/selective.py): the attention core, the elementwise
        # passes (norms, activation, residuals, softmax) and the block's tensor-parallel collectives
        recompute = (f_attn + f_ew) * hw.fwd_factor + tp_f
    b_gemm, b_ew, w_gemm = b_gemm * hw.bwd_factor, b_ew * hw.bwd_factor, w_gemm * hw.bwd_factor
    if layer.frozen:  # frozen weights get no weight gradient (a LoRA base: the adapters' are ~r/h of it)
        w_gemm *= max(0, layer.params - layer.frozen) / max(layer.params, 1)
    ep_f, ep_b = moe_comm(layer, plan, hw, act_bytes(plan))
    return LayerTime(F=F + ep_f, B=b_gemm + b_ew + tp_b + recompute + ep_b, W=w_gemm, recompute=recompute,
                     tp_fwd=tp_f, tp_bwd=tp_b + (tp_f if recompute and plan.activation_checkpointing == "full"
                                                 else 0.0),
                     flops_fwd=flops, flops_attn=attn_flops, ep_fwd=ep_f, ep_bwd=ep_b)


def async_tp_times(layer: Layer, plan: Layout, hw: Hardware, tp_per_node: int) -> tuple[OverlapTime, OverlapTime]:
    """``(forward, backward)`` tensor-parallel cost of ``layer`` for one micro-batch under ``plan.async_tp``
    (``tp_overlap`` module doc), without the sync skew. Its GEMMs at their tensor-parallel shapes, whole and in
    row pieces, with the calibration's block factors (the probe timed them whole)."""
    t, b = plan.tp, plan.micro_batch
    dtype = "fp32" if plan.precision == "fp32" else "bf16"
    eb = param_bytes(plan)

    def chunks(g: Gemm) -> GemmChunks:
        m, n, k, batch = _shape(g, b, t, plan.ep)

        def times(rows: float, launches: int = 1) -> tuple[float, float, float]:
            gemm = lambda a, c, d: hw.gemm_time(a, c, d, dtype=dtype, batch=batch, elem_bytes=eb)  # noqa: E731
            return (launches * gemm(rows, n, k) * hw.fwd_factor, launches * gemm(rows, k, n) * hw.bwd_factor,
                    launches * gemm(k, n, rows) * hw.bwd_factor)

        whole = times(m)
        return GemmChunks(fwd=whole[0], dgrad=whole[1], wgrad=whole[2], piece=lambda c: times(m / c),
                          ring_piece=lambda c: times(g.rows / c, b), in_bytes=m * k * batch * eb,
                          out_bytes=m * n * batch * eb, weight_elems=k * n * batch)

    cols = [chunks(g) for g in layer.gemms if g.weight and g.split == "col"]
    rows = [chunks(g) for g in layer.gemms if g.weight and g.split == "row"]
    coll = lambda op, nbytes: hw.collective_time(op, nbytes, t, per_node=tp_per_node,  # noqa: E731
                                                 algorithm="native")
    # ranks sharing one host's cores: every rank of the layout there (a CPU calibration), else irrelevant
    share = overlap_share(hw, min(plan.devices, hw.devices_per_node))
    w_deferred = plan.pp > 1 and plan.schedule in ("zb-h1", "zb-h2")
    return layer_overlap(collectives=layer.tp_allreduces, t=t, sequence_parallel=plan.sequence_parallel,
                         nbytes=layer.hidden * b * act_bytes(plan), coll=coll, cols=cols, rows=rows, hw=hw,
                         share=share, w_deferred=w_deferred, elem_bytes=act_bytes(plan),
                         # the weight gradient: fp32 beside fp32 or autocast weights, bf16 with bf16 weights
                         grad_bytes=2 if plan.precision == "bf16-mixed" else 4)
