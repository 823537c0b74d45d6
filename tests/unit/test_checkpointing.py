"""Activation checkpointing: same numbers as without, less activation memory, unchanged names, hooks once."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shardwise.models import GPT, GPTConfig, lm_loss, synthetic_batch
from shardwise.parallel.common.activation_checkpointing import (activation_memory, checkpoint_layers, checkpoint_report,
                                              checkpointed_modules, remove_checkpointing)

CFG = GPTConfig(n_layer=4)


def _pair(**kw: object) -> tuple[GPT, GPT]:
    """Two identical GPTs; the second is checkpointed with ``kw``."""
    torch.manual_seed(0)
    ref = GPT(CFG)
    ckpt = copy.deepcopy(ref)
    return ref, checkpoint_layers(ckpt, **kw)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(4, 32, CFG.vocab_size, torch.Generator().manual_seed(1))


@pytest.mark.parametrize("every", [1, 2, 3])
def test_same_loss_and_gradients_as_without_checkpointing(every: int) -> None:
    ref, ckpt = _pair(every=every)
    idx, targets = _batch()
    ref_loss = lm_loss(ref(idx), targets)
    ref_loss.backward()
    loss = lm_loss(ckpt(idx), targets)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    ref_grads = dict(ref.named_parameters())
    for name, p in ckpt.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-6, atol=1e-9, msg=name)


def test_dropout_is_replayed_identically_in_recomputation() -> None:
    torch.manual_seed(0)
    ref = GPT(GPTConfig(n_layer=2, dropout=0.3)).train()
    ckpt = checkpoint_layers(copy.deepcopy(ref))
    idx, targets = _batch()
    torch.manual_seed(42)
    lm_loss(ref(idx), targets).backward()
    torch.manual_seed(42)
    lm_loss(ckpt(idx), targets).backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in ckpt.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, rtol=1e-6, atol=1e-9, msg=name)


def test_every_selects_every_kth_block() -> None:
    assert checkpointed_modules(_pair(every=1)[1]) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert checkpointed_modules(_pair(every=2)[1]) == ["blocks.0", "blocks.2"]
    assert checkpointed_modules(_pair(every=3)[1]) == ["blocks.0", "blocks.3"]


def test_policy_selects_by_name_and_outermost_wins() -> None:
    _, model = _pair(policy=lambda name, m: name.endswith(".mlp"))
    assert checkpointed_modules(model) == [f"blocks.{i}.mlp" for i in range(4)]
    _, model = _pair(policy=lambda name, m: name.startswith("blocks.1"))
    assert checkpointed_modules(model) == ["blocks.1"]


def test_state_dict_keys_and_parameter_names_unchanged() -> None:
    ref, ckpt = _pair()
    assert list(ckpt.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ckpt.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert ckpt.lm_head.weight is ckpt.wte.weight
    ckpt.load_state_dict(ref.state_dict())                  # loads without key remapping


def test_activation_memory_is_strictly_lower_and_reported() -> None:
    ref, ckpt = _pair()
    idx, targets = _batch()
    plain = activation_memory(ref, lambda: lm_loss(ref(idx), targets))
    checkpointed = activation_memory(ckpt, lambda: lm_loss(ckpt(idx), targets))
    report = checkpoint_report(ckpt, lambda: lm_loss(ckpt(idx), targets))
    assert checkpointed < plain
    assert (report.with_checkpointing, report.without_checkpointing) == (checkpointed, plain)
    assert report.saved_bytes == plain - checkpointed > 0
    assert "MiB saved" in str(report) and len(report.checkpointed) == 4
    # Lower bound independent of the meter's code: the 4 block inputs (b, t, h) fp32 are still kept.
    b, t, h = idx.shape[0], idx.shape[1], CFG.n_embd
    assert checkpointed >= 4 * b * t * h * 4


def test_activation_memory_counts_saved_storages_once_and_skips_parameters() -> None:
    lin = nn.Linear(8, 8, bias=False)
    x = torch.randn(16, 8, requires_grad=True)
    # mm saves x (input) and the weight; the weight is a parameter -> only x's 16*8*4 bytes count.
    assert activation_memory(lin, lambda: lin(x)) == 16 * 8 * 4
    # x * x saves x twice: one storage, counted once.
    assert activation_memory(lin, lambda: (x * x).sum()) == 16 * 8 * 4


def test_gradient_hooks_fire_exactly_once_per_backward() -> None:
    _, model = _pair()
    idx, targets = _batch()
    post_calls: dict[str, int] = {}
    tensor_calls: dict[str, int] = {}
    for name, p in model.named_parameters():
        post_calls[name] = tensor_calls[name] = 0
        p.register_post_accumulate_grad_hook(lambda _p, n=name: post_calls.__setitem__(n, post_calls[n] + 1))
        p.register_hook(lambda g, n=name: tensor_calls.__setitem__(n, tensor_calls[n] + 1))
    for step in (1, 2):
        lm_loss(model(idx), targets).backward()
        assert set(post_calls.values()) == {step}, post_calls
        assert set(tensor_calls.values()) == {step}, tensor_calls


class _SharedBlocks(nn.Module):
    """Two blocks that use one shared Linear: its gradient arrives from two checkpointed regions."""

    def __init__(self) -> None:
        super().__init__()
        shared = nn.Linear(4, 4)
        self.blocks = nn.ModuleList([nn.Sequential(shared, nn.Tanh()), nn.Sequential(shared, nn.Tanh())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_weight_shared_across_checkpointed_blocks_accumulates_once() -> None:
    # The reentrant form would run one inner backward per block and fire this hook twice.
    model = checkpoint_layers(_SharedBlocks())
    weight = model.blocks[0][0].weight
    calls = []
    weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad.clone()))
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    assert len(calls) == 1
    reference = _SharedBlocks()
    reference.load_state_dict(model.state_dict())
    reference(x).sum().backward()
    torch.testing.assert_close(calls[0], reference.blocks[0][0].weight.grad, rtol=1e-6, atol=1e-9)


def test_no_grad_forward_skips_recomputation_machinery() -> None:
    ref, ckpt = _pair()
    idx, _ = _batch()
    with torch.no_grad():
        torch.testing.assert_close(ckpt(idx), ref(idx), rtol=0, atol=0)


def test_remove_checkpointing_and_deepcopy() -> None:
    _, ckpt = _pair()
    clone = copy.deepcopy(ckpt)
    assert checkpointed_modules(clone) == checkpointed_modules(ckpt)
    assert clone.blocks[0].forward.module is clone.blocks[0]  # the copy recomputes its own block
    remove_checkpointing(ckpt)
    assert checkpointed_modules(ckpt) == []
    checkpoint_layers(ckpt, every=2)                          # re-applying after removal is allowed


def test_bad_input() -> None:
    _, ckpt = _pair()
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_layers(ckpt)
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="every must be a positive int"):
        checkpoint_layers(GPT(CFG), every=0)
    with pytest.raises(ValueError, match=r"matched no module in Sequential .*policy="):
        checkpoint_layers(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="the given policy matched no module"):
        checkpoint_layers(GPT(CFG), policy=lambda name, m: False)
    with pytest.raises(ValueError, match="call checkpoint_layers"):
        checkpoint_report(GPT(CFG), lambda: None)
