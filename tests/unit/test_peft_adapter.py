"""PEFT adapter directories (``shardwise.checkpoint.peft_adapter``) against ``peft`` itself: what peft saves reads
back into our ``Llama`` + ``apply_lora`` with equal logits, what we write ``peft.PeftModel.from_pretrained`` loads
with equal logits (relative 1e-5, fp32), and every refusal is one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.peft_adapter import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, check_adapter,
                                               read_peft_config, read_peft_dir, target_modules_for, write_peft_dir)
from shardwise.models.hf_config import hf_config_from_dict
from shardwise.models.llama import Llama
from shardwise.models.lora import LoRAConfig, apply_lora

peft = pytest.importorskip("peft")
tf = pytest.importorskip("transformers")

HF = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, use_cache=False)
R, ALPHA, SEQ = 4, 8.0, 8
IDS = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(3))


def _base(seed: int = 0, **over) -> "tf.LlamaForCausalLM":
    torch.manual_seed(seed)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**{**HF, **over})).eval()


def _ours(base: "tf.LlamaForCausalLM", targets: tuple[str, ...], *, rslora: bool = False) -> Llama:
    """Our Llama holding ``base``'s weights, LoRA applied, B drawn non-zero (the update is not a no-op)."""
    model = Llama(hf_config_from_dict({**HF, "model_type": "llama"}), block_size=SEQ)
    result = model.load_state_dict(base.state_dict(), strict=False)
    assert not result.missing_keys, result.missing_keys
    apply_lora(model, LoRAConfig(r=R, alpha=ALPHA, targets=targets, use_rslora=rslora, seed=5))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if ".lora_" in k}


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("rslora", [False, True])
def test_written_directory_loads_in_peft_with_equal_logits(tmp_path: Path, rslora: bool) -> None:
    ours = _ours(_base(), ("q_proj", "v_proj", "down_proj"), rslora=rslora)
    fields = {"r": R, "alpha": ALPHA, "dropout": 0.0, "use_rslora": rslora}
    modules = [n for n, _ in _base().named_modules() if n]
    adapted = sorted({k.rsplit(".", 2)[0] for k in _adapters(ours)})
    config = adapter_config(fields, target_modules_for(adapted, modules), base_model="some/base")
    write_peft_dir(tmp_path / "adapter", _adapters(ours), config)
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "adapter").eval()
    with torch.no_grad():
        _close(ours(IDS), loaded(input_ids=IDS).logits)
        assert not torch.allclose(_base()(input_ids=IDS).logits, ours(IDS), atol=1e-3)  # the adapters act
    saved = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert saved["peft_type"] == "LORA" and saved["target_modules"] == ["down_proj", "q_proj", "v_proj"]
    assert saved["base_model_name_or_path"] == "some/base" and saved["use_rslora"] is rslora


def test_peft_saved_directory_reads_into_our_model(tmp_path: Path) -> None:
    torch.manual_seed(1)
    pm = peft.get_peft_model(_base(), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["k_proj", "o_proj"],
                                                      init_lora_weights=False)).eval()
    pm.save_pretrained(tmp_path / "adapter")
    config, tensors = read_peft_dir(tmp_path / "adapter")
    assert config["r"] == R and sorted(config["target_modules"]) == ["k_proj", "o_proj"]
    ours = _ours(_base(), ("k_proj", "o_proj"))
    check_adapter(tensors, {k: v.shape for k, v in ours.state_dict().items()})
    check_adapter(tensors, {k: v.shape for k, v in _base().state_dict().items()}, complete=False)  # before LoRA
    assert set(tensors) == set(_adapters(ours))
    ours.load_state_dict(tensors, strict=False)
    with torch.no_grad():
        _close(ours(IDS), pm(input_ids=IDS).logits)


def _peft_dir(tmp_path: Path, **config_over) -> Path:
    ours = _ours(_base(), ("q_proj",))
    config = {**adapter_config({"r": R, "alpha": ALPHA}, ["q_proj"]), **config_over}
    return write_peft_dir(tmp_path / "adapter", _adapters(ours), config)


def test_adapter_name_in_keys_is_dropped(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = _peft_dir(tmp_path)
    state = load_file(str(path / ADAPTER_WEIGHTS))
    save_file({k.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
               for k, v in state.items()}, str(path / ADAPTER_WEIGHTS))
    _, tensors = read_peft_dir(path)
    assert sorted(tensors) == sorted(k.removeprefix("base_model.model.") for k in state)


@pytest.mark.parametrize("field,value,needle", [
    ("peft_type", "IA3", "only 'LORA'"), ("use_dora", True, "DoRA"), ("lora_bias", True, "lora_bias"),
    ("modules_to_save", ["lm_head"], "modules_to_save"), ("rank_pattern", {"q_proj": 8}, "rank_pattern"),
    ("alpha_pattern", {"q_proj": 2}, "alpha_pattern"), ("bias", "all", "bias"), ("r", 8, "not rank r = 8")])
def test_unsupported_adapters_are_one_line_errors(tmp_path: Path, field: str, value: object, needle: str) -> None:
    path = _peft_dir(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=needle) as err:
        read_peft_dir(path)
    assert "\n" not in str(err.value)
    if field != "r":  # the config alone tells: refused before any tensor is read
        with pytest.raises(ValueError, match=needle):
            read_peft_config(path)


def test_missing_files_and_stray_tensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="not a PEFT adapter directory, adapter_config.json and"):
        read_peft_dir(tmp_path)
    path = _peft_dir(tmp_path)
    state = load_file(str(path / ADAPTER_WEIGHTS))
    first = sorted(state)[0]
    save_file({**state, first.replace(".lora_A.weight", ".lora_magnitude_vector"): torch.ones(3)},
              str(path / ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match="not a LoRA tensor"):
        read_peft_dir(path)
    save_file({k: v for k, v in state.items() if ".lora_B." not in k}, str(path / ADAPTER_WEIGHTS))
    with pytest.raises(ValueError, match="has no .*lora_B.weight"):
        read_peft_dir(path)


def test_adapter_for_another_base_is_refused(tmp_path: Path) -> None:
    _, tensors = read_peft_dir(_peft_dir(tmp_path))
    wider = {k: v.shape for k, v in _base(hidden_size=48, head_dim=8).state_dict().items()}
    with pytest.raises(ValueError, match=r"has shape \(4, 32\), the model's is \(4, 48\).*another base"):
        check_adapter(tensors, wider, complete=False)
    gpt_like = {"blocks.0.attn.qkv.weight": (96, 32)}
    with pytest.raises(ValueError, match="has no linear layer 'model.layers.0.self_attn.q_proj'.*another"):
        check_adapter(tensors, gpt_like, complete=False)
    ours = _ours(_base(), ("q_proj", "v_proj"))
    with pytest.raises(ValueError, match="v_proj.lora_A.weight' is not in the adapter directory"):
        check_adapter(tensors, {k: v.shape for k, v in ours.state_dict().items()})


def test_out_that_is_not_an_adapter_directory_is_refused(tmp_path: Path) -> None:
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="without adapter_config.json, not an adapter directory"):
        _peft_dir(tmp_path)
    assert (tmp_path / "adapter" / "notes.txt").read_text() == "mine"
    (tmp_path / "adapter" / "notes.txt").unlink()
    first = _peft_dir(tmp_path)
    assert _peft_dir(tmp_path) == first and sorted(p.name for p in first.iterdir()) == [ADAPTER_CONFIG,
                                                                                        ADAPTER_WEIGHTS]


def test_target_modules_select_exactly_the_adapted() -> None:
    modules = ["h.0.attn.c_proj", "h.0.mlp.c_proj", "h.0.attn.c_attn", "h.1.attn.c_proj", "h.1.mlp.c_proj",
               "h.1.attn.c_attn"]
    assert target_modules_for(["h.0.attn.c_attn", "h.1.attn.c_attn"], modules) == ["c_attn"]
    assert target_modules_for(["h.0.attn.c_proj", "h.1.attn.c_proj"], modules) == ["h.0.attn.c_proj",
                                                                                  "h.1.attn.c_proj"]
