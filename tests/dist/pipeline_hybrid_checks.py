"""Rank-side checks for pipeline hybrids: pp x dp (overlapped, bucketed reduction; ZeRO-1), pp x tp
(tensor parallelism inside a stage), pp x dp x tp, and activation checkpointing per stage.

Reference: the same GPT (same seed) trained on one device with the same optimizer on the whole batch,
computed locally on every rank from code the pipeline never touches.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

import shardwise as sw
from shardwise.models.gpt import lm_loss
from shardwise.parallel.common.activation_checkpointing import activation_memory
from shardwise.parallel.tensor.apply_plan import gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh
from tests.dist.pipeline_checks import _batches, _model, _pieces, _rel_err

LR, ADAM_LR = 0.5, 1e-3


def _factory(case: dict):
    if case.get("opt") == "adamw":
        # eps 1e-5 as in the ZeRO tests: with the default 1e-8, m/sqrt(v) of near-zero gradients amplifies
        # float summation-order noise (1e-4 relative on one device vs another order) past the tolerance
        return partial(torch.optim.AdamW, lr=ADAM_LR, eps=1e-5, weight_decay=0.1)
    return partial(torch.optim.SGD, lr=LR)


def _reference(case: dict) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    model = _model(case["n_layer"], case.get("tie", True))
    opt = _factory(case)(model.parameters())
    losses, norms = [], []
    for idx, tgt in _batches():
        for x, y in _pieces(case, idx, tgt):  # accumulation: gradients of the pieces add up
            loss = lm_loss(model(x), y)
            loss.backward()
            losses.append(loss.item())
        if "clip" in case:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"])))
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _build(case: dict):
    m = mesh(**case["axes"])
    model = _model(case["n_layer"], case.get("tie", True))
    loss_fn = lm_loss
    if "tp" in case["axes"]:
        sp = case.get("sp", False)
        model = sw.parallelize(model, m, gpt_plan(model.config, sequence_parallel=sp), axis="tp",
                               sequence_parallel=sp)
        loss_fn = partial(vocab_parallel_cross_entropy, mesh=m, axis="tp")
    pipe = sw.pipeline(model, m, "pp", microbatches=case["m"], schedule=case["schedule"], loss_fn=loss_fn,
                       chunks=case.get("chunks", 1), dp_axis="dp" if "dp" in case["axes"] else None,
                       zero_stage=case.get("zero", 0),
                       checkpoint=case.get("ckpt", False), bucket_cap_mb=case.get("cap_mb", 25))
    return m, pipe


def _run_case(case: dict) -> dict:
    m, pipe = _build(case)
    opt = pipe.build_optimizer(_factory(case))
    losses, step_counts, opt_counts, in_backward, norms, held = [], [], [], [], [], []
    for idx, tgt in _batches():
        with sw.comm.CommCounter() as c:
            pieces = _pieces(case, idx, tgt)
            for j, (x, y) in enumerate(pieces):  # no_sync: the passes before the last reduce nothing
                with pipe.no_sync() if case.get("no_sync") and j < len(pieces) - 1 else contextlib.nullcontext():
                    losses.append(pipe.step(x, y))
        step_counts.append({op: c.count(op, axis="dp") for op in ("all_reduce", "reduce_scatter", "all_gather")}
                           | {"rs_ring": c.count("reduce_scatter", axis="dp", algorithm="ring"),
                              "rs_bytes": c.bytes("reduce_scatter", axis="dp"),
                              "ar_bytes": c.bytes("all_reduce", axis="dp")})
        in_backward.append(pipe.grad_sync.launched_in_backward if pipe.grad_sync else 0)
        if "clip" in case:
            norms.append(float(pipe.clip_grad_norm_(case["clip"])))
        sync = pipe.grad_sync  # what lives between the passes and the optimizer step (ZeRO-2/3: shards only)
        held.append({"full_grads": sum(g.numel() for g in sync.full_grads) if sync else 0,
                     "param_numel": sum(q.numel() for q in pipe.parameters()),
                     # finished reductions keep no handle (a waited one held its working buffers)
                     "handles": sum(b.handle is not None for b in sync.buckets) if sync else 0,
                     # ZeRO-1: every averaged shard a view of its bucket's buffer (no copy beside it)
                     "shards_in_buffer": all(b.grads is not None and b.shard is not None and
                                             b.shard.untyped_storage().data_ptr() == b.grads.untyped_storage().data_ptr()
                                             for b in sync.buckets) if sync else False})
        with sw.comm.CommCounter() as c:
            opt.step()
        opt_counts.append(c.count("all_gather", axis="dp", algorithm="ring"))
        opt.zero_grad()
    idx, tgt = _batches()[0]
    eval_loss = pipe.evaluate(idx, tgt) if case.get("eval") else None  # forward only, after training
    full = sw.full_state_dict(pipe)
    ref_losses, ref_state, ref_norms = _reference(case)
    if eval_loss is not None:
        ref_model = _model(case["n_layer"], case.get("tie", True))
        ref_model.load_state_dict(ref_state)
        with torch.no_grad():
            ref_eval = float(lm_loss(ref_model.eval()(idx), tgt))
    local = list(pipe.parameters())
    state_numel = sum(v.numel() for s in opt.state.values() for k, v in s.items()
                      if isinstance(v, torch.Tensor) and k == "exp_avg")
    return {
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
        "param_err": max(_rel_err(full[k], v) for k, v in ref_state.items()),
        "keys_ok": sorted(full) == sorted(ref_state),
        "norms": norms,
        "ref_norms": ref_norms,
        "step_counts": step_counts,
        "opt_all_gathers": opt_counts,
        "in_backward": in_backward,
        "n_params": len(local),
        "n_tied": len(pipe.tied),
        "local_numel": sum(q.numel() for q in local),
        "local_bytes": sum(q.numel() * q.element_size() for q in local),
        "state_numel": state_numel,
        "dp": m.size("dp") if "dp" in m.axes else 1,
        "held": held,
        "eval_err": abs(eval_loss - ref_eval) / abs(ref_eval) if eval_loss is not None else None,
        "n_groups": len(pipe.grad_sync.groups) if pipe.grad_sync else 0,
        "group_numel": sum(g.layout.total for g in pipe.grad_sync.groups) if pipe.grad_sync else 0,
        "shard_numel": sum(g.hi - g.lo for g in pipe.grad_sync.groups) if pipe.grad_sync else 0,
    }


def check_hybrids(cases: list[dict]) -> list[dict]:
    return [_run_case(case) for case in cases]


def check_stage_checkpointing() -> dict:
    """Bytes a stage's forward keeps for backward with checkpointing on vs off (the same stage, same input)."""
    m = mesh(pp=2)
    pipe = sw.pipeline(_model(3, True), m, "pp", microbatches=2, schedule="1f1b", loss_fn=lm_loss,
                       split=["blocks.1"], checkpoint=True)
    stage = next(iter(pipe.stages.values()))
    idx, _ = _batches()[0]
    x = idx if stage.index == 0 else torch.randn(idx.shape[0], idx.shape[1], 32, requires_grad=True)
    on = activation_memory(stage, lambda: stage(x))
    stage.checkpoint = False
    off = activation_memory(stage, lambda: stage(x))
    return {"on": on, "off": off, "stage": stage.index}


_BAD = {
    "zero_without_dp": dict(zero_stage=1),
    "zero_stage_4": dict(zero_stage=4, dp_axis="dp"),
    "checkpoint_not_bool": dict(checkpoint="yes"),
    "bucket_cap_zero": dict(bucket_cap_mb=0, dp_axis="dp"),
}


def check_hybrid_bad_input(names: list[str]) -> dict[str, str]:
    m = mesh(pp=2, dp=2)
    out: dict[str, str] = {}
    for name in names:
        with sw.comm.CommCounter() as c:
            try:
                sw.pipeline(_model(2, True), m, "pp", microbatches=2, loss_fn=lm_loss, **_BAD[name])
                out[name] = ""
            except (ValueError, TypeError) as e:
                out[name] = str(e)
        assert not c.records and c.messages_sent == 0, (name, c.records)
    return out


def check_mixed_precision(zero: int) -> dict:
    """pp 2 x dp 2 with sw.MixedPrecision (bf16 parameters, fp32 masters, fp32 reduction), 3 steps: the
    losses and final weights against fp32 on one device (bf16 tolerance), the dtypes and the bytes reduced. SGD:
    AdamW's normalisation turns bf16 rounding of near-zero gradients into whole steps of either sign."""
    case = dict(axes=dict(pp=2, dp=2), n_layer=2)
    m = mesh(**case["axes"])
    pipe = sw.pipeline(_model(2, True), m, "pp", microbatches=2, schedule="1f1b", loss_fn=lm_loss, dp_axis="dp",
                       zero_stage=zero, mixed_precision=sw.MixedPrecision())
    opt = pipe.build_optimizer(_factory(case))
    losses, reduced = [], []
    for idx, tgt in _batches():
        with sw.comm.CommCounter() as c:
            losses.append(pipe.step(idx, tgt))
        reduced.append(c.bytes("reduce_scatter", axis="dp"))
        opt.step()
        opt.zero_grad()
    ref_losses, ref_state, _ = _reference(case)
    full = sw.full_state_dict(pipe)
    groups = pipe.grad_sync.groups
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "param_err": max(_rel_err(full[k], v) for k, v in ref_state.items()),
            "full_dtypes": sorted({str(v.dtype) for v in full.values()}),
            "compute_dtypes": sorted({str(g.full.dtype) for g in groups}),
            "master_dtypes": sorted({str(g.master.dtype) for g in groups}),
            "reduced": reduced, "group_numel": sum(g.layout.total for g in groups),
            "param_dtypes": sorted({str(q.dtype) for q in pipe.parameters()})}


def check_no_sync_guard() -> str:
    """The ZeRO optimizer refuses to step gradients a no_sync step left unreduced."""
    m = mesh(pp=2, dp=2)
    pipe = sw.pipeline(_model(2, True), m, "pp", microbatches=2, schedule="1f1b", loss_fn=lm_loss, dp_axis="dp",
                       zero_stage=1)
    opt = pipe.build_optimizer(_factory({}))
    idx, tgt = _batches()[0]
    with pipe.no_sync():
        pipe.step(idx, tgt)
    try:
        opt.step()
    except RuntimeError as exc:
        return str(exc)
    return "no error"
