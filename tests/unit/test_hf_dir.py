"""Hugging Face model directories in and out (``shardwise.checkpoint.hf_dir``), the file side: a tiny
``transformers`` GPT-2 and Llama (random weights, saved here, nothing downloaded) attached to meta-device models
give transformers' logits; blocks read only their bytes; every bad directory is one line naming file and tensor;
the writer shards, indexes, replaces atomically and holds one tensor at a time."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardwise.checkpoint.hf_dir import (SafetensorsSource, attach_pretrained, gpt2_config_from_gpt,
                                         open_pretrained, pretrained_config, write_hf_dir)
from shardwise.models import GPT, GPTConfig
from shardwise.models.hf_config import load_hf_config
from shardwise.models.llama import Llama
from shardwise.parallel.common.materialize import materialize

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

GPT2 = dict(n_embd=64, n_layer=2, n_head=2, vocab_size=256, n_positions=64, activation_function="gelu")
LLAMA = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)


def _save(model, path: Path, **kw) -> Path:
    model.save_pretrained(path, **kw)
    return path


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> tuple[object, Path, Path]:
    """A tiny GPT2LMHeadModel saved whole and sharded (with an index)."""
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).eval()
    root = tmp_path_factory.mktemp("gpt2")
    return hf, _save(hf, root / "single"), _save(hf, root / "sharded", max_shard_size="100KB")


def _meta_gpt(directory: Path) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(**pretrained_config(directory, arch="gpt")))


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("which", [1, 2], ids=["single-file", "sharded"])
def test_gpt_from_gpt2_matches_transformers(gpt2, which):
    hf, directory = gpt2[0], gpt2[which]
    assert (directory / "model.safetensors.index.json").is_file() == (which == 2)
    model = _meta_gpt(directory)
    pretrained = attach_pretrained(model, directory, arch="gpt")
    materialize(model, "cpu")
    assert model.lm_head.weight is model.wte.weight  # tied, as GPT-2
    assert pretrained.bytes_read == sum(i.nbytes for i in pretrained.tensors.values())  # each tensor read once
    ids = _ids(256)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_from_hf_matches_transformers(tmp_path, tied):
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, tie_word_embeddings=tied)).eval()
    directory = _save(hf, tmp_path / "llama", max_shard_size="200KB")
    assert pretrained_config(directory, arch="llama")["model_type"] == "llama"
    with torch.device("meta"):
        model = Llama(load_hf_config(directory / "config.json"), 32)
    attach_pretrained(model, directory, arch="llama")
    materialize(model, "cpu")
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = _ids(300)
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_blocks_read_only_their_bytes(tmp_path):
    full = torch.randn(40, 24)
    save_file({"w": full.to(torch.bfloat16), "c": full.t().contiguous()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    pd = open_pretrained(tmp_path)
    src = SafetensorsSource(pd, "w", torch.float32)
    block = src.read((slice(10, 20),))
    assert torch.equal(block, full.to(torch.bfloat16)[10:20].float())  # exactly .float() of the whole
    assert pd.bytes_read == 10 * 24 * 2 < 40 * 24 * 2
    pd.bytes_read = 0
    cols = src.read((slice(None), slice(4, 8)))
    assert torch.equal(cols, full.to(torch.bfloat16)[:, 4:8].float()) and pd.bytes_read == 40 * 4 * 2
    pd.bytes_read = 0
    flat = src.read_flat(30, 70)  # elements 30..69: rows 1 and 2 only
    assert torch.equal(flat, full.to(torch.bfloat16).reshape(-1)[30:70].float()) and pd.bytes_read == 2 * 24 * 2
    t = SafetensorsSource(pd, "c", torch.float32, transpose=True)  # file (24, 40), view (40, 24)
    assert t.shape == (40, 24)
    pd.bytes_read = 0
    assert torch.equal(t.read((slice(5, 9), slice(2, 3))), full[5:9, 2:3]) and pd.bytes_read == 4 * 1 * 4
    assert torch.equal(t.read_flat(50, 100), full.reshape(-1)[50:100])
    assert torch.equal(t.read(), full)


def _corrupt(directory: Path, how: str) -> str:
    """Damage a sharded GPT-2 copy in one way; returns a fragment the error must hold."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["transformer.wte.weight"]
    if how == "no-config":
        (directory / "config.json").unlink()
        return "config.json: missing"
    if how == "no-weights":
        for p in [*directory.glob("*.safetensors"), directory / "model.safetensors.index.json"]:
            p.unlink()
        return "no weights file"
    if how == "missing-shard":
        (directory / shard).unlink()
        return f"names '{shard}'"
    if how == "truncated":
        raw = (directory / shard).read_bytes()
        (directory / shard).write_bytes(raw[:-100])
        return "truncated"
    if how == "absent-tensor":
        index["weight_map"]["transformer.wte.weight"] = index["weight_map"]["transformer.ln_f.bias"]
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        return "holds no tensor 'transformer.wte.weight'"
    cfg = json.loads((directory / "config.json").read_text())
    cfg["activation_function"] = "gelu_new"
    (directory / "config.json").write_text(json.dumps(cfg))
    return "exact GELU"


@pytest.mark.parametrize("how", ["no-config", "no-weights", "missing-shard", "truncated", "absent-tensor", "gelu-new"])
def test_bad_directory_is_one_line(gpt2, tmp_path, how):
    import shutil

    directory = tmp_path / "d"
    shutil.copytree(gpt2[2], directory)
    fragment = _corrupt(directory, how)
    with pytest.raises(ValueError) as exc:
        pretrained_config(directory, arch="gpt")
    assert fragment in str(exc.value) and "\n" not in str(exc.value)


def _single(tmp_path: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    tmp_path.mkdir(exist_ok=True)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config or GPT2))
    return tmp_path


def test_bad_tensors_are_one_line(gpt2, tmp_path):
    good = load_file(str(gpt2[1] / "model.safetensors"))
    cases = {
        "missing": ({k: v for k, v in good.items() if k != "transformer.ln_f.bias"}, "no tensor 'transformer.ln_f.bias'"),
        "shape": ({**good, "transformer.wpe.weight": good["transformer.wpe.weight"][:32]}, "has shape (32, 64)"),
        "dtype": ({**good, "transformer.ln_f.weight": good["transformer.ln_f.weight"].to(torch.int32)}, "stored as I32"),
        "unused": ({**good, "transformer.h.2.ln_1.weight": torch.ones(64)}, "taken by no parameter"),
    }
    for name, (tensors, fragment) in cases.items():
        directory = _single(tmp_path / name, tensors)
        with pytest.raises(ValueError) as exc:
            attach_pretrained(_meta_gpt(gpt2[1]), directory, arch="gpt")
        assert fragment in str(exc.value) and "model.safetensors" in str(exc.value), (name, exc.value)
        assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="not the meta device"):
        attach_pretrained(GPT(GPTConfig(**pretrained_config(gpt2[1], arch="gpt"))), gpt2[1], arch="gpt")
    # the causal-mask buffers of older GPT-2 files are no parameters, and are skipped
    old = _single(tmp_path / "old", {**{k.removeprefix("transformer."): v for k, v in good.items()},
                                     "h.0.attn.bias": torch.ones(1, 1, 64, 64)})
    attach_pretrained(_meta_gpt(gpt2[1]), old, arch="gpt")


def test_write_shards_index_and_replace(tmp_path):
    tensors = {f"t{i}": torch.full((100, 10), float(i)) for i in range(5)}  # 4000 bytes each
    out = tmp_path / "out"
    index = write_hf_dir(iter(tensors.items()), {"model_type": "x"}, out, max_shard_bytes=9000)
    files = sorted(p.name for p in out.iterdir())
    assert files == ["config.json", "model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    assert index["metadata"]["total_size"] == 20000 and index["weight_map"]["t4"] == "model-00003-of-00003.safetensors"
    pd = open_pretrained(out)
    for k, v in tensors.items():
        assert torch.equal(pd.source(k).read(), v)
    write_hf_dir(iter([("a", torch.arange(6).view(2, 3).t())]), {"model_type": "y"}, out)  # replaces it
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert torch.equal(load_file(str(out / "model.safetensors"))["a"], torch.arange(6).view(2, 3).t())

    def failing():
        yield "a", torch.zeros(3)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        write_hf_dir(failing(), {}, out)
    assert json.loads((out / "config.json").read_text()) == {"model_type": "y"}  # the old one, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary left
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not a model directory"):
        write_hf_dir(iter([("a", torch.zeros(1))]), {}, tmp_path / "other")


def test_writer_holds_one_tensor_at_a_time(tmp_path):
    alive: list[weakref.ref] = []

    def tensors():
        for i in range(6):
            assert all(r() is None for r in alive), f"tensor {i - 1} still held when tensor {i} is made"
            t = torch.randn(64, 64).t()  # a transposed view: written without a contiguous copy of the whole
            alive.append(weakref.ref(t))
            yield f"t{i}", t
            del t

    write_hf_dir(tensors(), {}, tmp_path / "out", max_shard_bytes=40000)


def test_writer_peak_memory(tmp_path):
    """RSS high-water mark of a subprocess writing 5 tensors of 16 MB: about one tensor, not five."""
    code = f"""
import torch, re
from shardwise.checkpoint.hf_dir import write_hf_dir
def hwm():
    return int(re.search(r"VmHWM:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
base = hwm()
def tensors():
    for i in range(5):
        yield f"t{{i}}", torch.full((1024, 4096), float(i)).t()
write_hf_dir(tensors(), {{}}, {str(tmp_path / "out")!r}, max_shard_bytes=2 * 2**24)
print(hwm() - base)
"""
    # glibc raises its mmap threshold after freeing a large block, so freed tensors then stay in the heap and
    # RSS counts them: a fixed threshold makes RSS measure what is held (about 28 MB here: one tensor + a chunk)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    grew = int(proc.stdout.split()[-1])
    assert grew < 2.5 * 2**24, f"peak RSS grew by {grew / 2**20:.0f} MB writing 5 tensors of 16 MB"
    assert len(open_pretrained(tmp_path / "out").tensors) == 5


def test_gpt2_config_round_trip():
    cfg = {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "n_embd": 64, "dropout": 0.1,
           "bias": False, "tie_weights": False}
    hf = transformers.GPT2Config(**gpt2_config_from_gpt(cfg))
    assert (hf.n_positions, hf.activation_function, hf.tie_word_embeddings, hf.resid_pdrop) == (64, "gelu", False, 0.1)


def test_header_size_mismatch_is_named(tmp_path):
    save_file({"w": torch.zeros(4)}, str(tmp_path / "model.safetensors"))
    raw = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(raw + b"\0" * 8)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="bytes past the last tensor"):
        open_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(ValueError, match="truncated"):
        open_pretrained(tmp_path)
