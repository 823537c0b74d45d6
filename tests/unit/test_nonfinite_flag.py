"""``local_flag``: the fused local half of the trainer's non-finite check (the agreement over ranks is tested in
tests/dist/nonfinite_checks.py). fp32 gradients stack their norms directly; other dtypes are converted first."""

from __future__ import annotations

import pytest
import torch

from shardwise.runtime.nonfinite import Grad, local_flag


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), -float("inf")])
def test_any_nonfinite_gradient_or_loss_sets_the_flag(dtype, bad):
    grads = [Grad(torch.randn(7), ("a",)), Grad(torch.randn(3, 4).to(dtype), ("b",)), Grad(torch.empty(0), ("c",))]
    loss = torch.tensor(2.5)
    flag = local_flag(loss, grads)
    assert flag.dtype == torch.float32 and flag.shape == (1,) and float(flag) == 0.0
    if bad is None:
        return
    grads[1].tensor[2, 1] = bad
    assert float(local_flag(loss, grads)) == 1.0
    grads[1].tensor[2, 1] = 0.0
    assert float(local_flag(torch.tensor(bad), grads)) == 1.0  # the loss alone
    assert float(local_flag(torch.tensor(1.0), [])) == 0.0


def test_huge_finite_gradients_are_finite_and_every_position_is_seen():
    # a norm of these would overflow float32 (3e38² ...); their extremes do not
    huge = [Grad(torch.full((1000,), 3e38), ("big",)), Grad(torch.full((5,), -3e38), ("neg",))]
    assert float(local_flag(torch.tensor(1.0), huge)) == 0.0
    g = torch.randn(4, 257)
    for pos in (0, 511, g.numel() - 1):  # first, middle, last element of a non-contiguous view
        for bad in (float("nan"), float("inf"), -float("inf")):
            view = g.t()  # non-contiguous: the check reads a copy of it, which must be taken now
            flat = g.view(-1)
            old = float(flat[pos])
            flat[pos] = bad
            assert float(local_flag(torch.tensor(0.0), [Grad(view, ("t",))])) == 1.0, (pos, bad)
            flat[pos] = old
    assert float(local_flag(torch.tensor(0.0), [Grad(g.t(), ("t",))])) == 0.0
