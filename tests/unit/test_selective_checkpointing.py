"""Selective activation checkpointing (``parallel/common/selective.py``): equal to no checkpointing on one device
for our GPT, our Llama and a transformers decoder; keeps what the planner says it keeps; never recomputes a
weight matmul; refuses a model without attention; the config's old booleans still mean full/none."""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.common.activation_checkpointing import activation_memory, checkpoint_layers
from shardwise.planner import Layout, ModelSpec
from shardwise.planner.memory import layer_activation_bytes
from shardwise.runtime.config import apply_overrides, config_from_dict
from shardwise.runtime.config_schema import Config, ParallelConfig


def _gpt(h: int = 128, layers: int = 2, s: int = 128) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_embd=h, n_layer=layers, n_head=4, block_size=s))


def _llama() -> nn.Module:
    from shardwise.models.hf_config import HFDecoderConfig
    from shardwise.models.llama import Llama

    torch.manual_seed(0)
    c = HFDecoderConfig(model_type="llama", vocab_size=64, hidden_size=96, intermediate_size=192,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
                        rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=128)
    return Llama(c, block_size=64)


def _hf(attn: str) -> nn.Module | None:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn)
    return LlamaForCausalLM(cfg)


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if hasattr(model, "config") and hasattr(model.config, "use_cache"):  # transformers: no KV cache in training
        return model(x, use_cache=False).logits
    return model(x)


def _grads(model: nn.Module, x: torch.Tensor, mode: str, blocks: str) -> tuple[float, list[torch.Tensor]]:
    m = copy.deepcopy(model)
    if mode != "none":
        checkpoint_layers(m, policy=lambda name, _: name.rsplit(".", 1)[0].endswith(blocks) and name[-1].isdigit(),
                          mode=mode)
    loss = lm_loss(_logits(m, x), x.roll(-1, 1))
    loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("which", ["gpt", "llama", "hf-eager", "hf-sdpa"])
def test_selective_equals_no_checkpointing_on_one_device(which):
    model = {"gpt": _gpt, "llama": _llama}.get(which, lambda: _hf(which.split("-")[1]))()
    if model is None:
        pytest.skip("transformers is not installed")
    blocks = "blocks" if which == "gpt" else "layers"
    x = torch.randint(0, 64, (2, 48))
    want_loss, want = _grads(model, x, "none", blocks)
    got_loss, got = _grads(model, x, "selective", blocks)
    assert got_loss == want_loss and len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_selective_keeps_what_the_planner_counts():
    """Bytes saved for backward (autograd's and the policy's cache) against the planner's kept activations,
    for three GPT shapes: full < selective < none, and selective within 1 % of the planner."""
    for h, layers, s, b in ((128, 2, 256, 2), (256, 4, 128, 2), (64, 3, 512, 1)):
        model = _gpt(h, layers, s)
        x = torch.randint(0, 64, (b, s))
        spec = ModelSpec.gpt(n_layer=layers, n_embd=h, n_head=4, vocab_size=64, seq_len=s, block_size=s)
        measured = {}
        for mode in ("none", "full", "selective"):
            m = copy.deepcopy(model)
            if mode != "none":
                checkpoint_layers(m, mode=mode)
            measured[mode] = activation_memory(m, lambda: lm_loss(m(x), x))
        assert measured["full"] < measured["selective"] < 0.75 * measured["none"], measured
        planned = sum(layer_activation_bytes(layer, Layout(micro_batch=b, activation_checkpointing="selective"))[0]
                      for layer in spec.layers)
        assert planned == pytest.approx(measured["selective"], rel=0.01), (h, layers, s, b)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_selective_recomputes_no_weight_matmul():
    """Matmuls run during backward: the same number with selective as without checkpointing (their outputs are
    kept); full checkpointing runs each block's forward matmuls again."""
    x = torch.randint(0, 64, (2, 64))
    counts = {}
    for mode in ("none", "selective", "full"):
        m = _gpt()
        if mode != "none":
            checkpoint_layers(m, mode=mode)
        loss = lm_loss(m(x), x)
        with _CountMatmuls() as counter:
            loss.backward()
        counts[mode] = counter.count
    assert counts["selective"] == counts["none"] < counts["full"], counts


class _MLPOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def test_a_model_without_attention_is_refused_before_any_work():
    with pytest.raises(ValueError, match=r"block 'blocks\.0' .* no attention module.*activation_checkpointing full"):
        checkpoint_layers(_MLPOnly(), mode="selective")
    checkpoint_layers(_MLPOnly(), mode="full")  # full checkpointing needs no attention
    with pytest.raises(ValueError, match="not one of"):
        checkpoint_layers(_gpt(), mode="partial")


def test_the_config_takes_modes_and_the_old_booleans():
    for value, want in (("selective", "selective"), ("full", "full"), ("none", "none"), ("true", "full"),
                        ("false", "none"), (True, "full"), (False, "none")):
        cfg = apply_overrides(Config(), {"parallel.activation_checkpointing": value})
        assert cfg.parallel.activation_checkpointing == want, value
    assert ParallelConfig(activation_checkpointing=True).activation_checkpointing == "full"  # Python configs
    saved = json.loads(json.dumps(dataclasses.asdict(Config())))  # a run saved when the field was a bool
    saved["parallel"]["activation_checkpointing"] = True
    assert config_from_dict(saved).parallel.activation_checkpointing == "full"
    with pytest.raises(ValueError, match=r"activation_checkpointing = 'some' is not allowed; choose one of"):
        apply_overrides(Config(), {"parallel.activation_checkpointing": "some"})
