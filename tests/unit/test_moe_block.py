"""The MoE block on one process against references written out longhand: routing, grouped experts against a
per-token loop, the per-sequence balancing loss and capacity rule, the selection bias, and the edge cases
(an expert that gets no token, every assignment dropped)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.moe import MoE, MoESettings
from shardwise.models.moe_balance import capacity_mask, sequence_aux, step_stats, update_bias


def _block(**kw: object) -> MoE:
    torch.manual_seed(0)
    base = dict(n_experts=6, top_k=2, hidden=32, ffn=16)
    m = MoE(MoESettings(**{**base, **kw}))  # type: ignore[arg-type]
    for p in m.parameters():
        torch.nn.init.normal_(p, 0.0, 0.2)
    return m


def _longhand(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax/sigmoid scores, top-k, optional renormalisation, SwiGLU experts, shared expert."""
    s = m.settings
    flat = x.reshape(-1, x.size(-1))
    out = torch.zeros_like(flat)
    for n in range(flat.size(0)):
        logits = m.gate.weight @ flat[n]
        scores = logits.softmax(-1) if s.router == "softmax" else logits.sigmoid()
        w, idx = scores.topk(s.top_k)
        if s.renorm:
            w = w / w.sum()
        for j in range(s.top_k):
            gu = m.experts.gate_up_proj[idx[j]] @ flat[n]
            g, u = gu[: s.ffn], gu[s.ffn:]
            out[n] += w[j] * (m.experts.down_proj[idx[j]] @ (F.silu(g) * u))
        if s.shared_ffn:
            sh = m.shared_expert(flat[n:n + 1])[0]
            if s.shared_gate:
                sh = sh * torch.sigmoid(m.shared_expert_gate.weight @ flat[n])
            out[n] += sh
    return out.view_as(x)


@pytest.mark.parametrize("kw", [{}, {"router": "sigmoid"}, {"renorm": False}, {"shared_ffn": 24, "shared_gate": True},
                                {"top_k": 1}])
def test_block_equals_longhand(kw):
    m = _block(**kw)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(m(x), _longhand(m, x), rtol=1e-5, atol=1e-6)


def test_grouped_equals_loop_forward_and_backward():
    x = torch.randn(3, 8, 32, requires_grad=True)
    outs, grads = [], []
    for impl in ("grouped", "loop"):
        m = _block(n_experts=16)
        m.experts.impl = impl
        y = m(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append([p.grad.clone() for p in m.parameters()] + [x.grad.clone()])
        x.grad = None
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sequence_aux_longhand():
    torch.manual_seed(1)
    b, t, e, k = 3, 7, 5, 2
    scores = torch.rand(b, t, e).softmax(-1)
    chosen = scores.topk(k).indices
    want = 0.0
    for s in range(b):
        f = torch.zeros(e)
        for tok in range(t):
            for j in range(k):
                f[chosen[s, tok, j]] += 1
        f = f * e / (k * t)
        want += float((f * scores[s].mean(0)).sum())
    assert math.isclose(float(sequence_aux(scores, chosen, e)), want / b, rel_tol=1e-6)


def test_capacity_keeps_the_earliest_per_sequence():
    chosen = torch.tensor([[[0, 1], [0, 2], [0, 1], [2, 0]]])  # (1, 4, 2), 3 experts
    keep = capacity_mask(chosen, n_experts=3, factor=0.75)  # cap = ceil(0.75·2·4/3) = 2
    # expert 0 is chosen at (0,0), (1,0), (2,0), (3,1): the first two kept; expert 1 twice; expert 2 twice
    assert keep.tolist() == [[[True, True], [True, True], [False, True], [True, False]]]
    # the rule is per sequence: a second sequence does not consume the first one's capacity
    keep2 = capacity_mask(torch.cat([chosen, chosen]), n_experts=3, factor=0.75)
    assert keep2[1].tolist() == keep[0].tolist()


def test_all_dropped_and_starved_experts_still_give_gradients():
    m = _block(capacity_factor=1e-9)  # capacity ceil(tiny) = 1 per expert and sequence
    x = torch.randn(2, 6, 32)
    m(x).sum().backward()
    assert m.experts.gate_up_proj.grad is not None and m.balance.dropped > 0
    m2 = _block(n_experts=8, bias_rate=0.1, router="sigmoid")
    m2.gate.expert_bias.copy_(torch.tensor([9.0, 9.0] + [-9.0] * 6))  # only experts 0 and 1 are ever picked
    m2(x).sum().backward()
    assert m2.experts.down_proj.grad[2:].abs().sum() == 0 and m2.experts.down_proj.grad[:2].abs().sum() > 0
    stats = step_stats(torch.nn.ModuleDict({"moe": m2}), reset=False)["moe"]
    assert stats["starved"] == 6 and stats["min"] == 0 and stats["max"] == 2 * 6


def test_bias_moves_toward_the_even_load():
    m = _block(n_experts=4, bias_rate=0.5, router="sigmoid")
    m.balance.load = torch.tensor([10.0, 0.0, 5.0, 5.0], dtype=torch.float64)
    update_bias(torch.nn.ModuleDict({"moe": m}))
    assert m.gate.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]


def test_aux_gradient_reaches_the_router_only_when_training():
    m = _block(aux_coef=1.0)
    x = torch.randn(2, 4, 32)
    m(x).sum().backward()
    with_aux = m.gate.weight.grad.clone()
    m.zero_grad()
    twin = _block(aux_coef=0.0)
    twin(x).sum().backward()
    assert not torch.allclose(with_aux, twin.gate.weight.grad)
    m.zero_grad()
    m.eval()
    m(x).sum().backward()
    torch.testing.assert_close(m.gate.weight.grad, twin.gate.weight.grad)


def test_gpt_layers_and_errors():
    c = GPTConfig(n_layer=4, n_experts=4, moe_first_dense=1, moe_every=2)
    assert [c.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    model = GPT(c)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["MLP", "MoE", "MLP", "MoE"]
    for kw, words in [({"top_k": 5}, "top_k (5) must be between 1 and model.n_experts (4)"),
                      ({"capacity_factor": -1.0}, "capacity_factor must be >= 0"),
                      ({"moe_first_dense": 4}, "leaves no MoE layer")]:
        with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
            GPTConfig(n_layer=4, n_experts=4, **kw)


def test_validation_and_no_grad_passes_leave_the_loads_alone():
    m = _block()
    x = torch.randn(2, 4, 32)
    m(x).sum().backward()
    load = m.balance.load.clone()
    with torch.no_grad():
        m(x)
    m.eval()
    m(x)
    assert torch.equal(m.balance.load, load) and m.balance.passes == 1
