"""Reference GPT: shapes, weight tying, parameter count, determinism, causality, input validation."""

from __future__ import annotations

import pytest
import torch

from shardwise.models import GPT, GPTConfig, lm_loss, synthetic_batch


def _model(seed: int = 0, **kw: object) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**kw))


def test_logits_shape_and_loss_near_uniform() -> None:
    model = _model()
    idx, targets = synthetic_batch(3, 17, 256, torch.Generator().manual_seed(1))
    logits = model(idx)
    assert logits.shape == (3, 17, 256)
    # Small init (std 0.02) gives nearly uniform predictions: loss ≈ ln(256) ≈ 5.545.
    assert abs(lm_loss(logits, targets).item() - torch.log(torch.tensor(256.0)).item()) < 0.1


def test_tied_weights_share_storage_and_receive_both_gradients() -> None:
    model = _model()
    assert model.lm_head.weight is model.wte.weight
    assert model.lm_head.weight.data_ptr() == model.wte.weight.data_ptr()
    idx, targets = synthetic_batch(2, 8, 256, torch.Generator().manual_seed(2))
    lm_loss(model(idx), targets).backward()
    tied_grad = model.wte.weight.grad.clone()

    # Same weights, untied into two independent copies: the tied gradient must be the sum of both uses.
    untied = _model(tie_weights=False)
    untied.load_state_dict({k: v for k, v in model.state_dict().items()})
    untied.lm_head.weight.data.copy_(model.wte.weight.data)
    lm_loss(untied(idx), targets).backward()
    emb_grad, head_grad = untied.wte.weight.grad, untied.lm_head.weight.grad
    assert emb_grad.abs().sum() > 0 and head_grad.abs().sum() > 0
    torch.testing.assert_close(tied_grad, emb_grad + head_grad, rtol=1e-5, atol=1e-7)


def test_num_params_counts_tied_weight_once() -> None:
    cfg = GPTConfig()
    h, v, L, T = cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.block_size
    # per block: 2 LayerNorms (2h each) + qkv (3h² + 3h) + proj (h² + h) + fc (4h² + 4h) + proj (4h² + h)
    per_block = 4 * h + 12 * h * h + 9 * h
    expected_tied = v * h + T * h + L * per_block + 2 * h
    assert _model().num_params() == expected_tied
    assert _model(tie_weights=False).num_params() == expected_tied + v * h


def test_gpt2_124m_preset_has_the_published_size() -> None:
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("gpt2-124m"))
    assert 124_000_000 < model.num_params() < 125_000_000


def test_same_seed_same_model_different_seed_different_model() -> None:
    a, b, c = _model(5), _model(5), _model(6)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.blocks[0].attn.qkv.weight, c.blocks[0].attn.qkv.weight)


def test_residual_projections_use_scaled_init() -> None:
    model = _model(0, n_embd=256, n_head=4, n_layer=8)
    fc_std = model.blocks[0].mlp.fc.weight.std().item()
    proj_std = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(fc_std - 0.02) < 0.002
    assert abs(proj_std - 0.02 / 4.0) < 0.0005  # 0.02 / sqrt(2 * 8)


def test_causal_future_tokens_do_not_change_earlier_logits() -> None:
    model = _model().eval()
    idx, _ = synthetic_batch(2, 12, 256, torch.Generator().manual_seed(3))
    changed = idx.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 256
    with torch.no_grad():
        base, after = model(idx), model(changed)
    torch.testing.assert_close(base[:, :7], after[:, :7], rtol=0, atol=0)
    assert not torch.allclose(base[:, 7:], after[:, 7:])


def test_sequence_longer_than_block_size_is_rejected_with_values() -> None:
    model = _model(block_size=8)
    with pytest.raises(ValueError, match=r"sequence length 9 exceeds block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.int64))
    assert model(torch.zeros(1, 8, dtype=torch.int64)).shape == (1, 8, 256)


@pytest.mark.parametrize("kw, match", [
    ({"n_embd": 65, "n_head": 2}, "divisible by n_head"),
    ({"n_layer": 0}, "n_layer must be a positive int"),
    ({"dropout": 1.0}, r"dropout must be in \[0, 1\)"),
    ({"vocab_size": -3}, "vocab_size"),
])
def test_config_validation(kw: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kw)


def test_presets_and_unknown_preset() -> None:
    assert GPTConfig.preset("gpt-tiny") == GPTConfig()
    small = GPTConfig.preset("gpt-small")
    with torch.device("meta"):
        assert 1_000_000 < GPT(small).num_params() < 10_000_000
    with pytest.raises(ValueError, match="gpt-small"):
        GPTConfig.preset("gpt-huge")


def test_synthetic_batch_targets_are_next_tokens_and_reproducible() -> None:
    idx, targets = synthetic_batch(2, 10, 50, torch.Generator().manual_seed(7))
    idx2, _ = synthetic_batch(2, 10, 50, torch.Generator().manual_seed(7))
    assert torch.equal(idx, idx2)
    assert idx.dtype == torch.int64 and idx.shape == targets.shape == (2, 10)
    assert torch.equal(idx[:, 1:], targets[:, :-1])
    assert int(idx.max()) < 50 and int(idx.min()) >= 0


def test_gpt_carries_its_pipeline_units_and_tensor_plan():
    """The pipeline asks the model (PipelineCuttable) for its cut points; running the units in order is forward."""
    from shardwise.parallel.pipeline.stage import PipelineCuttable, model_units
    from shardwise.parallel.tensor.apply_plan import gpt_plan

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3)).eval()
    assert isinstance(model, PipelineCuttable)
    units = model_units(model)
    assert [u.name for u in units] == ["wte", "blocks.0", "blocks.1", "blocks.2", "ln_f"]
    idx, _ = synthetic_batch(2, 8, model.config.vocab_size)
    x = idx
    for u in units:
        x = u.fn(x)
    assert torch.equal(x, model(idx))
    assert gpt_plan(model.config, sequence_parallel=True) == model.tensor_parallel_plan(sequence_parallel=True)
    assert "blocks.*.attn.qkv" in gpt_plan(model)


def test_meta_model_draws_nothing_and_counts_like_the_real_model() -> None:
    """The launcher counts parameters on the meta device; a random initialiser there would import torch._dynamo
    (~1 s per launch). Checked in a fresh interpreter: this one may have imported it already."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from shardwise.runtime.config import load_config\n"
            "from shardwise.runtime.model_build import meta_model, num_params, build_model\n"
            "cfg = load_config(preset='gpt-small')\n"
            "m = meta_model(cfg.model)\n"
            "assert all(p.device.type == 'meta' for p in m.parameters())\n"
            "assert 'torch._dynamo' not in sys.modules, 'a meta initialiser imported dynamo'\n"
            "print(num_params(cfg.model), build_model(cfg.model).num_params())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    meta_count, real_count = map(int, out.stdout.split())
    assert meta_count == real_count > 0
