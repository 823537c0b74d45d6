"""``shardwise export RUN --format hf --out DIR``: a Hugging Face model directory that ``transformers`` loads to our
model's logits, and that ``attach_pretrained`` reads back bit-identically — for a reference-GPT run (GPT-2 layout,
trained by ``shardwise train``) and for Llama-family runs (HF's own keys; checkpoints saved in this process as the
trainer saves them). Tokenizer files travel along; failures are one line, exit 2, and leave ``--out`` as it was."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.hf_dir import attach_pretrained, open_pretrained, pretrained_config
from shardwise.checkpoint.layout import model_pieces, tied_aliases
from shardwise.checkpoint.sharded import save_checkpoint
from shardwise.cli import main as cli_main
from shardwise.cli.export import consolidate
from shardwise.models import GPT, GPTConfig
from shardwise.models.hf_config import hf_config_from_dict, load_hf_config
from shardwise.models.llama import Llama
from shardwise.parallel.common.materialize import materialize
from tests.e2e.runs import cli

transformers = pytest.importorskip("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
GPT_FIELDS = [f.name for f in dataclasses.fields(GPTConfig)]


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory) -> Path:
    """A 2-step run of the default tiny GPT on one rank, checkpointed at step 2, with a tokenizer file."""
    cwd = tmp_path_factory.mktemp("gpt-run")
    proc = cli(cwd, "train", "--data.global_batch", "4", "--parallel.micro_batch", "2", "--train.steps", "2",
               "--train.ckpt_every", "2", "--parallel.nproc", "1", "--train.name", "g")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (cwd / "runs" / "g" / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    return cwd / "runs" / "g"


def _export(run: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    rc = cli_main(["export", str(run), "--format", "hf", "--out", str(out), *extra])
    return rc, capsys.readouterr().err


def _ours(tensors: dict[str, torch.Tensor], model: torch.nn.Module) -> torch.nn.Module:
    model.load_state_dict(tensors)
    return model.eval()


def _hf(out: Path) -> torch.nn.Module:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _check_logits(ours: torch.nn.Module, out: Path, vocab: int) -> None:
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(_hf(out)(ids).logits, ours(ids), rtol=1e-5, atol=1e-5)


def _check_read_back(model: torch.nn.Module, out: Path, arch: str, want: dict[str, torch.Tensor]) -> None:
    attach_pretrained(model, out, arch=arch)
    materialize(model, "cpu")
    got = model.state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_gpt_run_exports_gpt2(gpt_run, tmp_path, capsys):
    out = tmp_path / "hf"
    rc, err = _export(gpt_run, out, capsys, "--max-shard-mb", "0.1")
    assert rc == 0, err
    assert (out / "model.safetensors.index.json").is_file() and (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["activation_function"] == "gelu"
    tensors, meta = consolidate(gpt_run)
    cfg = GPTConfig(**{k: v for k, v in json.loads(meta["model_config"]).items() if k in GPT_FIELDS})
    _check_logits(_ours(tensors, GPT(cfg)), out, cfg.vocab_size)
    assert pretrained_config(out, arch="gpt") == {k: getattr(cfg, k) for k in
                                                  ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias",
                                                   "tie_weights")}
    with torch.device("meta"):
        meta_model = GPT(cfg)
    _check_read_back(meta_model, out, "gpt", tensors)


def test_gpt_without_biases_exports_zeros(one_rank_mesh, tmp_path, capsys):
    cfg = GPTConfig(vocab_size=96, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False, tie_weights=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    run = _saved_run(tmp_path / "run", model, one_rank_mesh, {"config": {"model": cfg.to_dict()}})
    rc, err = _export(run, tmp_path / "hf", capsys)
    assert rc == 0, err
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    held = open_pretrained(tmp_path / "hf").tensors
    assert "transformer.h.1.attn.c_attn.bias" in held and "lm_head.weight" in held
    _check_logits(model.eval(), tmp_path / "hf", cfg.vocab_size)


def _saved_run(run: Path, model: torch.nn.Module, mesh, state: dict) -> Path:
    state = {"step": 1, "aliases": tied_aliases(model), **state}
    save_checkpoint(run / "checkpoints", 1, model_pieces(model, mesh), mesh=mesh, state=state, rank_state={})
    return run


@pytest.mark.parametrize("example", ["tiny-llama.json", "tiny-qwen2.json"], ids=["llama-untied", "qwen2-tied-bias"])
def test_llama_family_run_exports_hf(one_rank_mesh, tmp_path, capsys, example):
    hf_config = load_hf_config(EXAMPLES / example)
    torch.manual_seed(0)
    model = Llama(hf_config, 32)
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    (pretrained / "tokenizer_config.json").write_text("{}")
    state = {"config": {"model": {"hf_config": str(EXAMPLES / example), "block_size": 32, "pretrained": str(pretrained)}},
             "hf_config": hf_config.hf_dict()}
    run = _saved_run(tmp_path / "run", model, one_rank_mesh, state)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # an earlier export: replaced
    rc, err = _export(run, out, capsys)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors",
                                                     "tokenizer_config.json"]
    _check_logits(model.eval(), out, hf_config.vocab_size)
    tensors = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with torch.device("meta"):
        meta_model = Llama(hf_config_from_dict(pretrained_config(out, arch="llama")), 32)
    _check_read_back(meta_model, out, "llama", tensors)


def test_failed_export_leaves_out_alone(gpt_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(gpt_run, run)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text('{"previous": true}')
    step = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    shard = step / "rank00000.safetensors"
    shard.write_bytes(shard.read_bytes()[:-64])
    rc, err = _export(run, out, capsys)
    assert rc == 2 and err.startswith("shardwise export: error: ") and err.count("\n") == 1, err
    assert json.loads((out / "config.json").read_text()) == {"previous": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]
