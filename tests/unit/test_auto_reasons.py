"""``str(sw.auto(...))`` says, under each module it leaves replicated, why — and what would change that: pinned by
the user, no layout for the module type, no split fits its shapes (which dimension), or too small to pay (the best
alternative's predicted step against the chosen one, in numbers)."""

from __future__ import annotations

import re

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.mesh import MeshLayout


class _Mixed(nn.Module):
    """One module per reason: ``a`` (pinned), ``s`` (tiny: splits do not pay), ``odd`` (7 features over tp=2),
    ``norm`` (a LayerNorm: no tensor-parallel layout)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.s, self.b = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 7)
        self.odd, self.norm, self.head = nn.Linear(7, 7), nn.LayerNorm(7), nn.Linear(7, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (4, 16) -> (4, 16)
        return self.head(self.norm(self.odd(self.b(self.s(self.a(x))))))


def _reasons() -> tuple[dict[str, str], float]:
    torch.manual_seed(0)
    plan = sw.auto(_Mixed(), MeshLayout(("tp",), (2,)), example_inputs=(torch.randn(4, 16),), pins={"a": "B"})
    lines = str(plan).splitlines()
    out = {}
    for i, line in enumerate(lines):
        m = re.match(r"  (\w+)\s+B\s", line)
        if m and i + 1 < len(lines) and lines[i + 1].strip().startswith("replicated:"):
            out[m.group(1)] = lines[i + 1].strip()
    assert plan.time_s is not None
    return out, plan.time_s


def test_every_replicated_module_has_a_reason():
    reasons, _ = _reasons()
    assert set(reasons) == {"a", "s", "b", "odd", "norm", "head"}, reasons  # every module stays replicated here


def test_pinned_module_says_so():
    reasons, _ = _reasons()
    assert "pinned by the user" in reasons["a"] and "drop that pin" in reasons["a"], reasons["a"]
    assert "pinned" not in reasons["s"]


def test_module_type_without_layout_is_named():
    reasons, _ = _reasons()
    assert "no tensor-parallel layout for LayerNorm" in reasons["norm"], reasons["norm"]


def test_indivisible_dimension_is_named():
    reasons, _ = _reasons()
    odd = reasons["odd"]
    assert "out_features=7 is not divisible by tp=2" in odd and "in_features=7 is not divisible by tp=2" in odd, odd
    assert "choose a tp size" in odd


def test_too_small_to_pay_gives_both_prices():
    reasons, step = _reasons()
    m = re.search(r"too small to pay: the best alternative, (\w+), predicts a step of ([\d.]+) ms vs ([\d.]+) ms "
                  r"replicated \(\+([\d.]+) %\)", reasons["s"])
    assert m is not None, reasons["s"]
    alt, chosen = float(m.group(2)), float(m.group(3))
    assert chosen == round(step * 1e3, 3) and alt > chosen  # the chosen plan's step, and the dearer alternative
    assert abs(float(m.group(4)) - (alt - chosen) / chosen * 100) < 1.0
    assert f"pins={{'s': '{m.group(1)}'}}" in reasons["s"]  # the hint names the pin that would force it
