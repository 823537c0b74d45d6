"""Layout-independent initial values (``parallel/common/init_rules.py``, ``materialize.py``): any range or block
of a parameter drawn alone equals the same elements of the whole; the GPT and Llama built on the meta device and
materialised equal the same models built for real; a meta model without a rule starts from its layers' reset."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.parallel.common.init_rules import BLOCK, draw, draw_full
from shardwise.parallel.common.materialize import InitSource, SliceSource, ensure_sources, read_flat


@pytest.mark.parametrize("start,stop", [(0, 10), (5, BLOCK + 7), (BLOCK - 1, 3 * BLOCK + 2), (2 * BLOCK, 2 * BLOCK)])
def test_any_range_equals_the_same_elements_of_the_whole(start, stop):
    numel = 3 * BLOCK + 5
    whole = draw(sw.Normal(0.0, 0.02), 11, "blocks.0.mlp.fc.weight", numel, 0, numel)
    part = draw(sw.Normal(0.0, 0.02), 11, "blocks.0.mlp.fc.weight", numel, start, stop)
    assert torch.equal(part, whole[start:stop])


def test_values_depend_on_seed_and_name_and_follow_the_rule():
    a = draw_full(sw.Normal(0.0, 0.02), 1, "w", (300, 400))
    assert not torch.equal(a, draw_full(sw.Normal(0.0, 0.02), 2, "w", (300, 400)))
    assert not torch.equal(a, draw_full(sw.Normal(0.0, 0.02), 1, "v", (300, 400)))
    assert abs(float(a.std()) - 0.02) < 5e-4 and abs(float(a.mean())) < 5e-4
    u = draw_full(sw.Uniform(-0.5, 0.25), 1, "u", (1000,))
    assert float(u.min()) >= -0.5 and float(u.max()) < 0.25
    assert torch.equal(draw_full(sw.Constant(1.0), 1, "c", (3, 2)), torch.ones(3, 2))
    assert draw_full(sw.Normal(), 1, "w", (4,), dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="std >= 0"):
        sw.Normal(0.0, -1.0)
    with pytest.raises(ValueError, match="not inside"):
        draw(sw.Normal(), 1, "w", 10, 5, 11)


def test_blocks_read_only_their_rows():
    src = InitSource("w", sw.Normal(0.0, 1.0), 3, (50, 7), torch.float32)
    whole = src.read()
    assert torch.equal(src.read((slice(10, 20),)), whole[10:20])
    assert torch.equal(src.read((slice(None), slice(2, 5))), whole[:, 2:5])
    assert torch.equal(src.read_flat(33, 101), whole.reshape(-1)[33:101])
    with torch.device("meta"):
        meta = nn.Parameter(torch.empty(50, 7))
    meta._shardwise_source = src  # type: ignore[attr-defined]
    assert torch.equal(read_flat(meta, 0, 20, "cpu"), whole.reshape(-1)[:20])
    # a tp piece: rows 10-19 and 30-34, columns 2-5 of the whole, read only when asked for
    piece = SliceSource(src, [(10, 10), (30, 5)], (2, 5))
    want = torch.cat([whole[10:20, 2:5], whole[30:35, 2:5]])
    assert piece.shape == (15, 3) and torch.equal(piece.read(), want)
    assert torch.equal(piece.read_flat(4, 40), want.reshape(-1)[4:40])


@pytest.mark.parametrize("build", ["gpt", "llama"])
def test_meta_model_materialises_to_the_real_one(build):
    def make() -> nn.Module:
        if build == "gpt":
            return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, tie_weights=True))
        from shardwise.models.hf_config import hf_config_from_dict
        from shardwise.models.llama import Llama

        return Llama(hf_config_from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                                          "intermediate_size": 48, "num_hidden_layers": 2,
                                          "num_attention_heads": 4, "num_key_value_heads": 2}), 16)

    torch.manual_seed(5)
    real = make()
    torch.manual_seed(5)
    with torch.device("meta"):
        meta = make()
    sw.materialize(meta, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(real.state_dict().values(), meta.state_dict().values()))
    tied = [n for n, p in meta.named_parameters(remove_duplicate=False) if p is meta.lm_head.weight]
    assert len(tied) == (2 if build == "gpt" else 1)  # ties survive materialisation (the same Parameter)


class NoRule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.w = nn.Parameter(torch.empty(3))


def test_model_without_rules_uses_layer_resets_and_names_what_it_cannot_start():
    with torch.device("meta"):
        m = NoRule()
    with pytest.raises(ValueError, match=r"'w' \(3,\) is on the meta device and nothing says how to initialise it"):
        ensure_sources(m, seed=0)
    del m.w
    one, two = sw.materialize(m, "cpu"), None
    with torch.device("meta"):
        two = NoRule()
    del two.w
    sw.materialize(two, "cpu")
    assert torch.equal(one.a.weight, two.a.weight)  # same seed, same module name: same values
    assert not torch.equal(one.a.weight, one.b.weight)  # each module its own stream


def test_auto_plans_a_meta_model_as_the_real_one():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32)
    x = torch.randint(0, cfg.vocab_size, (4, 16))
    layout = sw.MeshLayout(("dp", "tp"), (1, 2))
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = GPT(cfg)
    torch.manual_seed(0)
    assert str(sw.auto(meta, layout, example_inputs=(x,))) == str(sw.auto(GPT(cfg), layout, example_inputs=(x,)))
    assert meta.wte.weight.is_meta  # tracing allocated nothing


def test_reset_values_are_never_reused_for_another_module_or_seed():
    from shardwise.parallel.common.materialize import ModuleResetSource

    with torch.device("meta"):
        lin, other = nn.Linear(5, 7), nn.Linear(5, 7)
    one = ModuleResetSource(lin, "lin", "weight", 1, (7, 5), torch.float32).read()
    two = ModuleResetSource(lin, "lin", "weight", 2, (7, 5), torch.float32).read()
    assert not torch.equal(one, two)  # the same module under another seed draws anew
    assert torch.equal(ModuleResetSource(other, "lin", "weight", 1, (7, 5), torch.float32).read(), one)
    ModuleResetSource.release()
    assert ModuleResetSource._cache is None
