"""The native Llama-family decoder (``models/llama.py``) against Hugging Face ``transformers`` built from the same
config and loaded with the same state dict: equal logits, loss and gradients (fp32). Also its pipeline units,
tensor-parallel plan and the counts the runtime and the planner use. Tests needing ``transformers`` skip cleanly
when it is not importable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shardwise.models.hf_config import hf_config_from_dict, load_hf_config
from shardwise.models.llama import Llama
from shardwise.parallel.tensor.styles import check_style, match_plan
from shardwise.runtime.config import load_config
from shardwise.runtime.model_build import attention_width, build_model, model_spec, num_params

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
BASE = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 72, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "max_position_embeddings": 128}
CASES = {
    "llama-gqa": {**BASE, "model_type": "llama", "rope_theta": 500000.0},
    "llama-bias-tied-headdim": {**BASE, "model_type": "llama", "attention_bias": True, "mlp_bias": True,
                                "tie_word_embeddings": True, "head_dim": 16},
    "llama-linear-rope": {**BASE, "model_type": "llama", "rope_scaling": {"rope_type": "linear", "factor": 4.0}},
    "llama3-rope": {**BASE, "model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 256,
                    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 400}},
    # (with hd 8 the wavelengths are 6.3, 167, 4456, 118 000: one kept, one interpolated, two scaled)
    "llama-mha-default-theta": {**BASE, "model_type": "llama", "num_key_value_heads": 4},
    "mistral": {**BASE, "model_type": "mistral", "sliding_window": 64},
    "qwen2": {**BASE, "model_type": "qwen2", "tie_word_embeddings": True, "rope_theta": 1e6},
    "qwen2-new-rope-spelling": {**BASE, "model_type": "qwen2", "rope_parameters": {"rope_type": "default",
                                                                                  "rope_theta": 2e5}},
}
HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf_model(raw: dict, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**raw)
    config._attn_implementation = "eager"  # the plainest reference: explicit softmax(QK^T / sqrt(hd)) V
    model = getattr(transformers, HF_CLASS[raw["model_type"]])(config)
    model.load_state_dict(state, strict=True)  # every key matches, in both directions
    return model.eval()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_loss_and_gradients_equal_transformers(name):
    raw = CASES[name]
    torch.manual_seed(0)
    ours = Llama(hf_config_from_dict(raw), block_size=48)
    with torch.no_grad():  # make every bias and norm weight non-trivial, so that a misplaced one shows
        for p in ours.parameters():
            p.add_(0.05 * torch.randn_like(p))
    theirs = hf_model(raw, ours.state_dict())
    idx = torch.randint(0, raw["vocab_size"], (2, 48), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, dims=1)
    a, b = ours(idx), theirs(input_ids=idx).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5)
    loss_a = F.cross_entropy(a.flatten(0, 1), targets.flatten())
    loss_b = F.cross_entropy(b.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-6, atol=1e-6)
    loss_a.backward()
    loss_b.backward()
    grads = dict(theirs.named_parameters())
    for key, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[key].grad, rtol=1e-4, atol=1e-6, msg=key)


def test_state_dict_keys_are_hf_names_and_tied_head_is_one_tensor():
    model = Llama(load_hf_config(EXAMPLES / "tiny-qwen2.json"), block_size=16)
    keys = set(model.state_dict())
    assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.bias", "model.layers.0.mlp.down_proj.weight",
            "model.norm.weight", "lm_head.weight"} <= keys
    assert "model.layers.0.self_attn.o_proj.bias" not in keys  # qwen2: q/k/v bias only
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not any("inv_freq" in k or "rotary" in k for k in keys)


def test_pipeline_units_compose_to_forward():
    torch.manual_seed(0)
    model = Llama(load_hf_config(EXAMPLES / "tiny-llama.json"), block_size=16)
    units = model.pipeline_units()
    assert [u.name for u in units] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    idx = torch.randint(0, 256, (2, 16))
    x = idx
    for u in units:
        x = u.fn(x)
    torch.testing.assert_close(x, model(idx), rtol=0, atol=0)
    with pytest.raises(ValueError, match="seq <= block_size 16"):
        units[0].fn(torch.zeros(1, 17, dtype=torch.long))


def test_tensor_parallel_plan_matches_every_projection_in_whole_heads():
    model = Llama(load_hf_config(EXAMPLES / "tiny-llama.json"), block_size=16)
    names = [n for n, _ in model.named_modules()]
    matched = match_plan(names, model.tensor_parallel_plan())
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears | {"model.embed_tokens"} == set(matched)  # every matrix is split, nothing else
    modules = dict(model.named_modules())
    for name, style in matched.items():
        check_style(name, modules[name], None, style, tp=2, sequence_parallel=False)
    with pytest.raises(ValueError, match="heads do not divide over tp=4"):  # 2 key/value heads
        check_style("model.layers.0.self_attn.k_proj", modules["model.layers.0.self_attn.k_proj"], None,
                    matched["model.layers.0.self_attn.k_proj"], tp=4, sequence_parallel=False)
    # with sequence parallelism the RMSNorms join (their weights' gradients summed over tp); nothing else
    sp = match_plan(names, model.tensor_parallel_plan(sequence_parallel=True))
    norms = {n for n, m in model.named_modules() if type(m).__name__ == "RMSNorm"}
    assert set(sp) == set(matched) | norms
    assert all(type(sp[n]).__name__ == "SequenceParallel" for n in norms)


@pytest.mark.parametrize("example", ["tiny-llama.json", "tiny-qwen2.json"])
def test_runtime_counts_are_the_real_models(example):
    transformers = pytest.importorskip("transformers")
    raw = json.loads((EXAMPLES / example).read_text())
    theirs = getattr(transformers, HF_CLASS[raw["model_type"]])(transformers.AutoConfig.for_model(**raw))
    cfg = load_config(overrides={"model.hf_config": str(EXAMPLES / example)})
    n = sum(p.numel() for p in theirs.parameters())  # parameters() counts a tied weight once
    assert num_params(cfg.model) == n
    assert isinstance(build_model(cfg.model), Llama)
    assert attention_width(cfg.model) == raw["num_attention_heads"] * (raw["hidden_size"] // raw["num_attention_heads"])
    spec = model_spec(cfg.model)
    assert spec.meta["builder"] == "llama" and spec.kv_heads == raw["num_key_value_heads"]
    # the planner's analytic count leaves out the q/k/v biases (qwen2: 3 per layer, h + 2·kv·hd elements)
    biases = sum(p.numel() for k, p in theirs.named_parameters() if k.endswith("proj.bias"))
    assert spec.params == n - biases
