"""``shardwise train --model.pretrained DIR`` end to end: a Hugging Face directory (GPT-2 sharded with an index;
a Llama with grouped-query attention) trained in every layout gives, at its first step, the loss transformers'
own model computes on the same batch (relative 1e-5, fp32); trained with learning rate 0 and exported with
``shardwise export --format hf`` it gives back every tensor bit-identical.

The data is a text whose every training window is the same (a block_size-periodic stream), so the batch of
step 1 is known without reproducing the sampler.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tests.e2e.runs import cli, losses

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

BLOCK = 32
PATTERN = bytes((7 * i + 3) % 26 + 97 for i in range(BLOCK))  # ASCII letters, period BLOCK
TRAIN = ["--train.steps", "1", "--optimizer.lr", "0", "--optimizer.min_lr", "0", "--optimizer.weight_decay", "0",
         "--data.global_batch", "4", "--parallel.micro_batch", "1", "--train.memory_check", "false"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=BLOCK, activation_function="gelu"))
    gpt2.save_pretrained(root / "gpt2", max_shard_size="40KB")  # several shards and an index
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False))
    llama.save_pretrained(root / "llama")
    (root / "data.txt").write_bytes(PATTERN * 200)
    return {"gpt2": root / "gpt2", "llama": root / "llama", "data": root / "data.txt", "root": root}


def _reference_loss(directory: Path) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).float().eval()
    window = torch.tensor(list(PATTERN * 2), dtype=torch.int64)[:BLOCK + 1]
    with torch.no_grad():
        logits = model(input_ids=window[None, :-1]).logits
    return float(torch.nn.functional.cross_entropy(logits[0], window[1:]))


def _train(dirs: dict[str, Path], name: str, kind: str, layout: list[str]) -> Path:
    proc = cli(dirs["root"], "train", "--model.pretrained", str(dirs[kind]), "--data.path", str(dirs["data"]),
               "--model.block_size", str(BLOCK), "--train.name", name, *TRAIN, *layout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dirs["root"] / "runs" / name


LAYOUTS = {"one": ["--parallel.nproc", "1"], "dp2": ["--parallel.nproc", "2"],
           "tp2": ["--parallel.nproc", "2", "--parallel.tp", "2"],
           "zero3": ["--parallel.nproc", "2", "--parallel.zero_stage", "3"],
           "pp2": ["--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.micro_batch", "2", "--parallel.pp_microbatches", "2"],
           "tp2-zero3": ["--parallel.nproc", "4", "--parallel.tp", "2", "--parallel.zero_stage", "3"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gpt2_first_loss_equals_transformers(dirs, layout):
    run = _train(dirs, f"gpt2-{layout}", "gpt2", LAYOUTS[layout])
    assert math.isclose(losses(run)[1], _reference_loss(dirs["gpt2"]), rel_tol=1e-5)


@pytest.mark.parametrize("layout", ["one", "tp2", "zero3", "pp2"])
def test_llama_first_loss_equals_transformers(dirs, layout):
    run = _train(dirs, f"llama-{layout}", "llama", LAYOUTS[layout])
    assert math.isclose(losses(run)[1], _reference_loss(dirs["llama"]), rel_tol=1e-5)


@pytest.mark.parametrize("kind,layout", [("gpt2", "zero3"), ("llama", "tp2")])
def test_lr0_round_trip_is_bit_identical(dirs, kind, layout):
    run = dirs["root"] / "runs" / f"{kind}-{layout}"
    if not run.is_dir():
        run = _train(dirs, f"{kind}-{layout}", kind, LAYOUTS[layout])
    out = dirs["root"] / f"export-{kind}-{layout}"
    proc = cli(dirs["root"], "export", str(run), "--format", "hf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    original, exported = _tensors(dirs[kind]), _tensors(out)
    assert set(original) <= set(exported), sorted(set(original) - set(exported))
    for key, value in original.items():
        assert torch.equal(exported[key], value), key
    assert json.loads((out / "config.json").read_text())["model_type"] == ("gpt2" if kind == "gpt2" else "llama")


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        for key, value in safetensors_torch.load_file(str(f)).items():
            out[key.removeprefix("transformer.")] = value
    return out


def test_bad_pretrained_directory_is_one_line(dirs, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((dirs["gpt2"] / "config.json").read_text())
    proc = cli(tmp_path, "train", "--model.pretrained", str(broken), "--train.steps", "1")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "safetensors" in lines[0], proc.stderr
    proc = cli(tmp_path, "train", "--model.pretrained", str(dirs["gpt2"]), "--model.n_layer", "3", "--train.steps", "1")
    assert proc.returncode == 2 and "contradicts model.pretrained" in proc.stderr, proc.stderr
