"""Range checks of the configuration's real-valued fields, and what sequence and context parallelism combine
with (``config.validate`` calls them): each error names the field, the value and a flag that fixes it. Pure."""

from __future__ import annotations

import math

from .config_schema import Config

__all__ = ["check_numbers", "check_sequence_parallel", "check_context_parallel", "check_async_tp", "check_selective",
           "check_offload"]


def check_numbers(config: Config) -> None:
    """The real-valued fields' ranges (timeout, bucket size, learning rates, clipping)."""
    p, t, o = config.parallel, config.train, config.optimizer
    if not 0 < t.timeout_s <= 3600:
        raise ValueError(f"train.timeout_s = {t.timeout_s} must be in (0, 3600] seconds; e.g. --train.timeout_s 60")
    if not p.bucket_cap_mb > 0:
        raise ValueError(f"parallel.bucket_cap_mb = {p.bucket_cap_mb} must be > 0 (megabytes); e.g. "
                         f"--parallel.bucket_cap_mb 25")
    if not o.lr >= 0:  # 0: the weights stay as loaded (a pretrained round trip, an evaluation run)
        raise ValueError(f"optimizer.lr = {o.lr} must be >= 0; e.g. --optimizer.lr 0.003")
    if not (o.clip_grad_norm >= 0 and math.isfinite(o.clip_grad_norm)):
        raise ValueError(f"optimizer.clip_grad_norm = {o.clip_grad_norm} must be a finite number >= 0 (0: no "
                         f"clipping); e.g. --optimizer.clip_grad_norm 1.0")
    if not 0 <= o.min_lr <= o.lr:
        raise ValueError(f"optimizer.min_lr = {o.min_lr} must be in [0, optimizer.lr = {o.lr}]; e.g. "
                         f"--optimizer.min_lr {o.lr / 10:g}")
    if not t.save_frozen and not config.model.pretrained:
        raise ValueError("train.save_frozen = false leaves the frozen parameters out of checkpoints, which a resume "
                         "then reads from model.pretrained, but none is given; set --model.pretrained DIR, or "
                         "--train.save_frozen true")



def check_sequence_parallel(config: Config) -> None:
    """``parallel.sequence_parallel`` needs tp > 1, no whole (replicated) embedding or head, and with pp > 1 a
    ``model.block_size`` that tp divides (a later pipeline stage gathers equal sequence pieces)."""
    p, block = config.parallel, config.model.block_size
    if not p.sequence_parallel:
        return
    if p.tp < 2:
        raise ValueError(f"parallel.sequence_parallel = true splits the sequence over tensor-parallel ranks, but "
                         f"parallel.tp = {p.tp}; use --parallel.tp 2 (or more), or --parallel.sequence_parallel false")
    if p.replicate:
        raise ValueError(f"parallel.sequence_parallel = true with parallel.replicate = {list(p.replicate)} is not "
                         f"supported: a whole embedding or head works on the whole sequence; drop one of them")
    if p.pp > 1 and block % p.tp:
        raise ValueError(f"parallel.sequence_parallel = true with parallel.pp = {p.pp} needs model.block_size = "
                         f"{block} divisible by parallel.tp = {p.tp} (a later pipeline stage splits the sequence "
                         f"evenly); use --model.block_size {block - block % p.tp}, or --parallel.pp 1")


def check_async_tp(config: Config) -> None:
    """``parallel.async_tp`` overlaps tensor-parallel collectives with the matmuls: it needs tp > 1."""
    p = config.parallel
    if p.async_tp and p.tp < 2:
        raise ValueError(f"parallel.async_tp = true overlaps tensor-parallel communication with the matmuls, but "
                         f"parallel.tp = {p.tp}; use --parallel.tp 2 (or more), or --parallel.async_tp false")


def check_offload(config: Config) -> None:
    """``parallel.offload`` moves ZeRO's optimizer (and stage 3's parameter) shards to host memory: it needs ZeRO
    (``params``: stage 3) and is not wired into pipelines."""
    p = config.parallel
    if p.offload == "none":
        return
    if p.zero_stage == 0:
        raise ValueError(f"parallel.offload = {p.offload} moves ZeRO's shards to host memory, but parallel.zero_stage = 0; "
                         f"use --parallel.zero_stage 1, 2 or 3 (params: 3), or --parallel.offload none")
    if p.offload == "params" and p.zero_stage != 3:
        raise ValueError(f"parallel.offload = params moves ZeRO-3's parameter shards to host memory, but "
                         f"parallel.zero_stage = {p.zero_stage} keeps whole parameters; use --parallel.zero_stage 3, "
                         f"or --parallel.offload optimizer")
    if p.pp > 1:
        raise ValueError(f"parallel.offload = {p.offload} with parallel.pp = {p.pp} is not supported (a pipeline's "
                         f"optimizer is not offloaded); use --parallel.offload none, or --parallel.pp 1")


def check_selective(config: Config) -> None:
    """``parallel.activation_checkpointing = selective`` in a pipeline needs a schedule without split backward:
    zero-bubble's weight-gradient pass differentiates each stage again, which torch's selective checkpoint
    forbids."""
    p = config.parallel
    if p.activation_checkpointing == "selective" and p.pp > 1 and p.pp_schedule.startswith("zb"):
        raise ValueError(f"parallel.activation_checkpointing = selective with parallel.pp_schedule = {p.pp_schedule!r}: "
                         f"its weight-gradient pass differentiates each stage a second time, which torch's selective "
                         f"checkpoint forbids; use --parallel.activation_checkpointing full, or --parallel.pp_schedule "
                         f"1f1b (or interleaved, gpipe)")


def check_context_parallel(config: Config) -> None:
    """``parallel.cp > 1`` (ring attention over a ``cp`` axis): each rank holds 2 of 2·cp equal chunks of every
    sequence, so 2·cp must divide ``model.block_size``; the ring computes attention without dropout."""
    p, m = config.parallel, config.model
    if p.cp <= 1:
        return
    if m.block_size % (2 * p.cp):
        good = max(2 * p.cp, m.block_size - m.block_size % (2 * p.cp))
        raise ValueError(f"parallel.cp = {p.cp} splits each sequence into 2·cp = {2 * p.cp} chunks, but "
                         f"model.block_size = {m.block_size} is not divisible by {2 * p.cp}; use --model.block_size "
                         f"{good}, or a cp whose 2·cp divides {m.block_size}")
    if m.dropout:
        raise ValueError(f"parallel.cp = {p.cp} runs ring attention, which has no dropout, but model.dropout = "
                         f"{m.dropout}; use --model.dropout 0, or --parallel.cp 1")


def check_mixed(config: Config) -> None:
    """``train.precision = bf16-mixed`` (bf16 weights and gradients, fp32 masters) keeps its fp32 masters in ZeRO's
    shards: it needs ZeRO, and inside a pipeline a dp axis to shard over and no tp (the checkpoint of a pipeline's
    masters is written from its dp shards); experts keep their own fp32 optimizer, so ep is refused."""
    p = config.parallel
    if config.train.precision != "bf16-mixed":
        return
    if p.zero_stage == 0:
        raise ValueError("train.precision = bf16-mixed keeps fp32 master weights in ZeRO's shards, but "
                         "parallel.zero_stage = 0; use --parallel.zero_stage 1, 2 or 3, or --train.precision bf16 "
                         "(autocast over fp32 weights)")
    dp = p.dp or p.nproc // max(1, p.tp * p.pp * getattr(p, "cp", 1))  # 0: not known yet (sw.pipeline checks it)
    if p.pp > 1 and (0 < dp < 2 or p.tp > 1):
        raise ValueError(f"train.precision = bf16-mixed with parallel.pp = {p.pp} needs parallel.dp >= 2 and "
                         f"parallel.tp = 1, got dp = {dp}, tp = {p.tp}; use --train.precision bf16, or change "
                         f"the layout")
    if getattr(p, "ep", 1) > 1:
        raise ValueError(f"train.precision = bf16-mixed with parallel.ep = {p.ep} is not supported (expert pieces "
                         f"keep their own fp32 optimizer); use --train.precision bf16")
