"""Zero-bubble's weight capture (``parallel/pipeline/weight_grad.py``) on modules with several outputs: the MoE
router is captured by its scores (its weights are a gather of them), an RNN or an attention module whose outputs
reach the parameters apart is not; and the split B/W gradients of a whole MoE block, balancing loss included,
equal one ``backward``."""

from __future__ import annotations

import torch
from torch import nn

from shardwise.models.moe import MoE, MoESettings, Router
from shardwise.parallel.pipeline.weight_grad import WeightCapture, _single_output, weight_gradients


def test_several_outputs_captured_only_through_one():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4, requires_grad=True)
    lstm, mha = nn.LSTM(4, 4, batch_first=True), nn.MultiheadAttention(4, 1, batch_first=True)
    assert _single_output(lstm(x), lstm, x) is None  # output and (h, c): one node, outputs apart
    assert _single_output(mha(x, x, x), mha, x) is None  # the attention weights reach in_proj_weight directly
    for k, renorm in ((2, True), (1, False)):
        router = Router(MoESettings(n_experts=4, top_k=k, hidden=4, ffn=4, renorm=renorm))
        nn.init.normal_(router.weight)
        flat = x.reshape(6, 4)
        scores, _, _ = out = router(flat)
        assert _single_output(out, router, flat) is scores


def test_split_backward_of_an_moe_block_equals_backward():
    torch.manual_seed(0)
    s = MoESettings(n_experts=4, top_k=2, hidden=16, ffn=16, shared_ffn=16, shared_gate=True, aux_coef=0.1)
    block = nn.Sequential(nn.Linear(16, 16), MoE(s))
    for q in block.parameters():
        nn.init.normal_(q, std=0.3)
    block[1].balance.grad_scale = 0.5  # the balancing loss's weight: its gradient enters at the block output
    x = torch.randn(2, 5, 16, requires_grad=True)
    block(x).square().mean().backward()
    want = {n: q.grad.clone() for n, q in block.named_parameters()}
    block.zero_grad(set_to_none=True)
    block[1].settings = MoESettings(**{**vars(s), "aux_coef": 0.0})
    block(x).square().mean().backward()
    router = block[1].gate.weight
    assert (router.grad - want["1.gate.weight"]).abs().max() > 1e-3  # the balancing loss is in the router's grad
    block[1].settings = s
    block.zero_grad(set_to_none=True)

    out, captured = WeightCapture(block).run(block, x)
    assert captured is not None and len(captured) == 7  # Linear, router, experts, the shared expert's 3, its gate
    loss = out.square().mean()
    ys = [y for _, y in captured]
    grads = torch.autograd.grad(loss, ys, retain_graph=True, allow_unused=True)  # B: dL/dy, no weight kernels
    assert all(q.grad is None for q in block.parameters())
    weight_gradients(block, [loss], list(zip(captured, grads)))  # W
    for n, q in block.named_parameters():
        torch.testing.assert_close(q.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)
