"""Reading a Hugging Face ``config.json`` (``models/hf_config.py``) and ``--model.hf_config`` in the training config:
fields, defaults, both rotary spellings, and every refusal as one line naming the field."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from shardwise.models.hf_config import hf_config_from_dict, load_hf_config
from shardwise.runtime.config import load_config, validate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
LLAMA = EXAMPLES / "tiny-llama.json"
QWEN2 = EXAMPLES / "tiny-qwen2.json"
BASE = {"model_type": "llama", "vocab_size": 100, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4}


def write(tmp_path: Path, raw: object) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def test_examples_parse_with_their_fields():
    c = load_hf_config(LLAMA)
    assert (c.model_type, c.vocab_size, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (
        "llama", 256, 64, 4, 2)
    assert c.head_dim == 16 and not c.tie_word_embeddings and not c.qkv_bias and c.rms_norm_eps == 1e-5
    q = load_hf_config(QWEN2)
    assert q.qkv_bias and not q.o_bias and q.tie_word_embeddings and q.rope_theta == 1e6 and q.vocab_size == 301


def test_defaults_of_an_absent_field_are_the_model_types():
    c = hf_config_from_dict(BASE)
    assert c.num_key_value_heads == 4 and c.head_dim == 8 and c.rope_theta == 10000.0
    assert c.max_position_embeddings == 2048 and c.sliding_window is None and c.rope_type == "default"
    m = hf_config_from_dict({**BASE, "model_type": "mistral"})
    assert m.sliding_window == 4096 and m.max_position_embeddings == 4096 * 32
    assert hf_config_from_dict({**BASE, "model_type": "qwen2", "sliding_window": 16}).sliding_window is None
    assert hf_config_from_dict({**BASE, "head_dim": 16}).head_dim == 16
    llama_bias = hf_config_from_dict({**BASE, "attention_bias": True, "mlp_bias": True})
    assert llama_bias.qkv_bias and llama_bias.o_bias and llama_bias.mlp_bias


def test_both_rotary_spellings():
    old = hf_config_from_dict({**BASE, "rope_theta": 500000.0, "rope_scaling": {"type": "linear", "factor": 2.0}})
    new = hf_config_from_dict({**BASE, "rope_parameters": {"rope_type": "linear", "rope_theta": 500000.0,
                                                           "factor": 2.0}})
    assert (old.rope_theta, old.rope_type, old.rope_factor) == (new.rope_theta, new.rope_type, new.rope_factor) == (
        500000.0, "linear", 2.0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    c = hf_config_from_dict({**BASE, "rope_scaling": llama3})
    assert (c.rope_type, c.rope_factor, c.rope_high_freq_factor, c.rope_original_max_positions) == ("llama3", 8, 4, 64)
    assert hf_config_from_dict(c.hf_dict()) == c  # what export writes reads back to the same architecture
    assert hf_config_from_dict({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_theta == 7


@pytest.mark.parametrize("change, words", [
    ({"model_type": "gemma"}, ["model_type = 'gemma'", "llama, mistral, qwen2"]),
    ({"model_type": None}, ["model_type = None"]),
    ({"hidden_act": "gelu"}, ["hidden_act = 'gelu'", "silu"]),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope type 'yarn'", "default, linear"]),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0}}, ["rope type 'dynamic'"]),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, ["rope low_freq_factor = None", "'llama3'"]),
    ({"rope_scaling": {"rope_type": "linear"}}, ["rope factor = None"]),
    ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor = 0.5", "1.0"]),
    ({"num_key_value_heads": 3}, ["num_attention_heads = 4", "num_key_value_heads = 3"]),
    ({"vocab_size": 0}, ["vocab_size = 0", "positive int"]),
    ({"hidden_size": None}, ["'hidden_size' is missing"]),
    ({"pretraining_tp": 2}, ["pretraining_tp = 2"]),
    ({"attention_dropout": 1.5}, ["attention_dropout = 1.5"]),
    ({"rope_theta": -1}, ["rope theta = -1"]),
])
def test_unsupported_or_bad_fields_are_named(change, words):
    raw = {**BASE, **change}
    with pytest.raises(ValueError) as err:
        hf_config_from_dict({k: v for k, v in raw.items() if v is not None or k == "model_type"})
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_unreadable_files_are_named(tmp_path):
    with pytest.raises(ValueError, match="no such file; pass the path of a Hugging Face config.json"):
        load_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{\"model_type\": ")
    with pytest.raises(ValueError, match=r"is not valid JSON \(line 1"):
        load_hf_config(bad)
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        load_hf_config(write(tmp_path, [1, 2]))


def test_sliding_window_only_where_it_changes_nothing():
    mistral = hf_config_from_dict({**BASE, "model_type": "mistral", "sliding_window": 32})
    mistral.check_block_size(32)  # a window as long as the sequence is plain causal attention
    with pytest.raises(ValueError, match="sliding_window = 32 is shorter than model.block_size = 33"):
        mistral.check_block_size(33)
    with pytest.raises(ValueError, match="model.block_size = 4096 exceeds max_position_embeddings = 2048"):
        hf_config_from_dict(BASE).check_block_size(4096)


# -- the training config -------------------------------------------------------------------------------------------
def test_hf_config_fills_the_model_shape():
    cfg = load_config(overrides={"model.hf_config": str(LLAMA), "model.block_size": "32"})
    m = cfg.model
    assert (m.vocab_size, m.n_layer, m.n_head, m.n_embd, m.tie_weights, m.block_size) == (256, 2, 4, 64, False, 32)
    assert Path(m.hf_config).is_absolute()
    again = load_config(overrides={f"model.{k}": v for k, v in dataclasses.asdict(m).items()})
    assert again.model == m  # a saved config (launch.json, a checkpoint's) reads back to itself


def test_relative_path_is_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, BASE)
    assert load_config(overrides={"model.hf_config": "config.json"}).model.hf_config == str(tmp_path / "config.json")


def test_a_flag_that_contradicts_the_file_is_refused():
    with pytest.raises(ValueError, match=r"model.n_layer = 4 contradicts model.hf_config .* makes it 2; drop "
                                         r"--model.n_layer"):
        load_config(overrides={"model.hf_config": str(LLAMA), "model.n_layer": "4"})
    same = load_config(overrides={"model.hf_config": str(LLAMA), "model.n_layer": "2"})  # agreeing is fine
    assert same.model.n_layer == 2


def test_layout_checks_know_the_hf_shape(tmp_path):
    hf = {"model.hf_config": str(LLAMA)}  # 4 query heads, 2 key/value heads
    with pytest.raises(ValueError, match=r"parallel.tp = 4 must divide num_key_value_heads = 2 .* \[1, 2\]"):
        validate(load_config(overrides={**hf, "parallel.tp": "4", "parallel.nproc": "4"}))
    with pytest.raises(ValueError, match=r"\['wte'\] cannot be kept whole; .* \['model.embed_tokens', 'lm_head'\]"):
        validate(load_config(overrides={**hf, "parallel.tp": "2", "parallel.replicate": "wte"}))
    with pytest.raises(ValueError, match="sliding_window = 16 is shorter than model.block_size = 64"):
        load_config(overrides={"model.hf_config": str(write(tmp_path, {**BASE, "model_type": "mistral",
                                                                         "sliding_window": 16})),
                               "model.block_size": "64"})
    with pytest.raises(ValueError, match="model.block_size = 512 exceeds max_position_embeddings = 256"):
        load_config(overrides={**hf, "model.block_size": "512"})
    with pytest.raises(ValueError, match=r"model.pp_split|names no module|cannot be cut"):
        validate(load_config(overrides={**hf, "parallel.pp": "2", "parallel.pp_split": "blocks.1"}))
    ok = validate(load_config(overrides={**hf, "parallel.pp": "2", "parallel.pp_split": "model.layers.1"}))
    assert ok.parallel.pp_split == ("model.layers.1",)



def test_a_checkpoint_from_before_hf_config_resumes_under_the_same_model():
    from shardwise.models.gpt import GPTConfig
    from shardwise.runtime.model_build import saved_model

    old = dataclasses.asdict(GPTConfig())  # what a checkpoint's [model] held before the field existed
    assert "hf_config" not in old
    assert saved_model(old) == dataclasses.asdict(load_config().model)
    assert saved_model(old) != dataclasses.asdict(load_config(overrides={"model.hf_config": str(LLAMA)}).model)


def test_replicate_names_the_hf_modules():
    from shardwise.runtime.config import replicated_modules
    from shardwise.runtime.prediction import gpt_spec

    llama = validate(load_config(overrides={"model.hf_config": str(LLAMA), "parallel.tp": "2",
                                            "parallel.replicate": "model.embed_tokens", "parallel.nproc": "2"}))
    assert replicated_modules(llama) == {"model.embed_tokens"}  # untied: the head stays vocabulary-parallel
    assert [layer.name for layer in gpt_spec(llama).layers if layer.replicated] == ["embed_tokens"]
    qwen2 = validate(load_config(overrides={"model.hf_config": str(QWEN2), "parallel.tp": "2",
                                            "parallel.replicate": "lm_head", "parallel.nproc": "2"}))
    assert replicated_modules(qwen2) == {"model.embed_tokens", "lm_head"}  # tied: one weight, both whole
    assert {layer.name for layer in gpt_spec(qwen2).layers if layer.replicated} == {"embed_tokens", "norm"}


def test_data_beyond_the_hf_vocabulary_is_refused(tmp_path):
    import numpy as np

    from shardwise.cli.train import _check_data

    data = tmp_path / "tokens.bin"
    np.arange(0, 400, dtype=np.uint16).repeat(8).tofile(data)  # token ids up to 399; the example's vocabulary: 256
    cfg = load_config(overrides={"model.hf_config": str(LLAMA), "data.path": str(data), "data.global_batch": "2"})
    with pytest.raises(ValueError, match=r"token id 399 but the model's vocab_size = 256 \(model.hf_config / model.pretrained\); use data tokenized"):
        _check_data(cfg)
