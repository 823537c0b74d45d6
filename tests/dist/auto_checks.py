"""Rank-side checks for ``sw.auto`` (run inside LocalWorld ranks by tests/dist/test_auto.py): plan on every rank,
apply the plan, and compare the loss and every parameter's gradient with the single-device model built from
the same seed on the same (full) batch; count the collectives of forward and backward."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.parallel.tensor.apply_plan import full_tensor, vocab_parallel_cross_entropy
from tests.dist import auto_models as am
from tests.dist.meshes import mesh


def _plan(model: nn.Module, m: sw.Mesh, inputs: tuple) -> tuple[sw.ParallelizePlan, int]:
    with CommCounter() as c:
        plan = sw.auto(model, m, inputs)
    return plan, len(c.records)


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def _loss(logits: torch.Tensor, y: torch.Tensor, plan: sw.ParallelizePlan, m: sw.Mesh) -> torch.Tensor:
    if plan.vocab_parallel_loss:
        return vocab_parallel_cross_entropy(logits, y, mesh=m, axis=plan.tp_axis)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def _reference(build, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    ref = build()
    logits = _logits(ref, x)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in ref.named_parameters()}


def _compare_grads(model: nn.Module, ref_grads: dict[str, torch.Tensor]) -> None:
    inner = getattr(model, "module", model)
    for name, p in inner.named_parameters():
        full = full_tensor(p, p.grad)  # gathered over the axes the parameter is split on
        torch.testing.assert_close(full, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda s, n=name: f"{n}: {s}")


def check_llama(which: str) -> dict:
    """tp=2 over the whole world: the plan is Megatron's; one all-reduce per column->row pair in forward."""
    build = am.TinyLlama if which == "own" else am.hf_llama
    m = mesh(tp=2)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (2, 16), generator=gen), torch.randint(0, 64, (2, 16), generator=gen)
    ref_loss, ref_grads = _reference(build, x, y)
    torch.manual_seed(0)
    model = build()
    plan, planning_comms = _plan(model, m, (x,))
    model = sw.parallelize(model, m, plan)  # the tp axis comes from the plan
    with CommCounter() as fwd:
        logits = _logits(model, x)
    loss = _loss(logits, y, plan, m)
    with CommCounter() as bwd:
        loss.backward()
    torch.testing.assert_close(loss.item(), ref_loss, rtol=1e-5, atol=0)
    _compare_grads(model, ref_grads)
    return {"plan": str(plan), "styles": {k: repr(v) for k, v in plan.items()}, "planning_comms": planning_comms,
            "fwd": fwd.by_op(), "bwd": bwd.by_op(), "vocab_loss": plan.vocab_parallel_loss}


def check_classifier() -> dict:
    """dp x tp = 2 x 2: backbone data parallel (replicated over tp), head split over the classes, vocab loss."""
    m = mesh(dp=2, tp=2)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 20000, (8,), generator=gen)
    ref_loss, ref_grads = _reference(am.Classifier, x, y)
    torch.manual_seed(0)
    model = am.Classifier()
    plan, planning_comms = _plan(model, m, (x,))
    model = sw.DataParallel(sw.parallelize(model, m, plan), m, axis=plan.dp_axes[0])
    c = m.coord("dp")
    xl, yl = x[c * 4:(c + 1) * 4], y[c * 4:(c + 1) * 4]
    with CommCounter() as fwd:
        logits = model(xl)
    with CommCounter() as loss_comms:
        loss = _loss(logits, yl, plan, m)
    with CommCounter() as bwd:
        loss.backward()
    total = loss.detach().clone()
    sw.comm.all_reduce(total, m, "dp", op="avg")
    torch.testing.assert_close(total.item(), ref_loss, rtol=1e-5, atol=0)
    _compare_grads(model, ref_grads)
    return {"styles": {k: repr(v) for k, v in plan.items()}, "tp": plan.tp_axis, "dp": plan.dp_axes,
            "planning_comms": planning_comms, "fwd": len(fwd.records), "loss": loss_comms.count("all_reduce", axis="tp"),
            "bwd_tp": bwd.count("all_reduce", axis="tp"), "bwd_dp": bwd.count("all_reduce", axis="dp"),
            "local_head_rows": model.module.head.weight.shape[0]}


def check_small_model() -> dict:
    """Mesh(dp=2): pure data parallelism; no collective in forward, one gradient bucket in backward."""
    m = mesh(dp=2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 32, generator=gen)
    y = torch.randn(64, 32, generator=gen)
    torch.manual_seed(0)
    ref = am.SmallMLP()
    F.mse_loss(ref(x), y).backward()
    torch.manual_seed(0)
    model = am.SmallMLP()
    plan, planning_comms = _plan(model, m, (x,))
    assert plan.tp_axis is None and dict(plan) == {}, str(plan)
    model = sw.DataParallel(model, m, axis=plan.dp_axes[0])
    c = m.coord("dp")
    with CommCounter() as fwd:
        out = model(x[c * 32:(c + 1) * 32])
    with CommCounter() as bwd:
        F.mse_loss(out, y[c * 32:(c + 1) * 32]).backward()
    for (name, p), r in zip(model.module.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-7, msg=lambda s, n=name: f"{n}: {s}")
    return {"planning_comms": planning_comms, "fwd": len(fwd.records), "bwd": bwd.by_op()}


def check_raw_input_layer() -> dict:
    """tp=2 under a memory budget that excludes data parallelism: the plan of a model whose first layer reads the
    raw input (``auto_models.WideInput``) runs, and its loss and gradients equal one device's."""
    m = mesh(tp=2)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 16, 4096, generator=gen), torch.randn(2, 16, 16, generator=gen)
    torch.manual_seed(0)
    ref = am.WideInput()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in ref.named_parameters()}
    torch.manual_seed(0)
    model = am.WideInput()
    plan = sw.auto(model, m, (x,), memory_budget=0.8 * 2**20)
    model = sw.parallelize(model, m, plan)
    loss = F.mse_loss(model(x), y)
    loss.backward()
    torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=0)
    _compare_grads(model, ref_grads)
    return {"styles": {k: repr(v) for k, v in plan.items()}, "tp": plan.tp_axis}
