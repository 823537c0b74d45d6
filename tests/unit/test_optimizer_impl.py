"""``optimizer.implementation``: fused, foreach and the loop step alike (to rounding), ``auto`` leaves a CPU run on
torch's default, and a fused optimizer handed the non-finite flag skips the step on the device (weights, moments
and step count untouched) — the device-side skip of ``runtime/host_overlap.py``. CPU: torch has fused AdamW and
SGD kernels on CPU since 2.4, so the fused path runs here too."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from shardwise.runtime.config_schema import OptimizerConfig
from shardwise.runtime.optimizer_impl import implementation_kwargs, set_found_inf, supports_found_inf, torch_optimizers
from shardwise.runtime.strategy import build_optimizer


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 8))


def _train(o: OptimizerConfig, steps: int = 4) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    model = _model()
    opt = build_optimizer(list(model.parameters()), o)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_fused_foreach_and_loop_agree_to_rounding(name: str) -> None:
    o = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1)
    ref, opt = _train(dataclasses.replace(o, implementation="loop"))
    assert opt.param_groups[0]["foreach"] is False and not opt.param_groups[0]["fused"]
    for how in ("foreach", "fused"):
        got, opt = _train(dataclasses.replace(o, implementation=how))
        assert opt.param_groups[0][how], (how, opt.param_groups[0])
        for a, b in zip(ref, got):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    moved = _train(o, steps=0)[0]
    assert any(not torch.equal(a, b) for a, b in zip(ref, moved))  # the steps changed the weights


def test_auto_is_torch_default_on_cpu_and_fused_on_cuda_tensors() -> None:
    o = OptimizerConfig(implementation="auto")
    assert implementation_kwargs(list(_model().parameters()), o) == {}  # CPU: unchanged from earlier versions
    ints = [nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)]
    assert implementation_kwargs(ints, o) == {}
    meta = [nn.Parameter(torch.empty(2, device="meta"))]
    assert implementation_kwargs(meta, o) == {}  # not CUDA: torch decides
    assert implementation_kwargs([], dataclasses.replace(o, implementation="fused")) == {"fused": True}


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_found_inf_skips_the_step_on_the_device(name: str) -> None:
    model = _model()
    opt = build_optimizer(list(model.parameters()), OptimizerConfig(name=name, implementation="fused"))
    assert supports_found_inf(opt) and torch_optimizers(opt) == [opt]
    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # state exists (moments, step count)
    before = [p.detach().clone() for p in model.parameters()]
    state = [{k: v.clone() for k, v in opt.state[p].items() if torch.is_tensor(v)} for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    set_found_inf(opt, torch.ones(1))
    opt.step()
    set_found_inf(opt, None)
    assert "found_inf" not in opt.__dict__
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    for s, p in zip(state, model.parameters()):
        assert all(torch.equal(v, opt.state[p][k]) for k, v in s.items()), name
    set_found_inf(opt, torch.zeros(1))  # a finite step goes through
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_loop_optimizer_does_not_take_found_inf() -> None:
    opt = build_optimizer(list(_model().parameters()), OptimizerConfig(implementation="loop"))
    assert not supports_found_inf(opt)
    assert not supports_found_inf(object())
