"""``shardwise export --format hf``: the tokens travel with the weights. ``config.json`` and
``generation_config.json`` carry the special ids of the run's source model, prepared dataset or byte-level data (not
``transformers``' architecture defaults), and the directory holds a tokenizer that ``AutoTokenizer`` loads and that
encodes text as training did — for a byte-level run one written by the export itself, with or without
``tokenizers`` installed — so that ``shardwise generate DIR`` accepts it."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch

from shardwise.checkpoint.layout import model_pieces, tied_aliases
from shardwise.checkpoint.sharded import save_checkpoint
from shardwise.cli import main as cli_main
from shardwise.models import GPT, GPTConfig
from shardwise.models.hf_config import load_hf_config
from shardwise.models.llama import Llama
from tests.e2e.generate_dirs import bpe_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
logging.getLogger("transformers").setLevel(logging.ERROR)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
TEXT = "The cat watches a blue boat. Héllo ☃ 🎉\n\tdone"


def _saved_run(run: Path, model: torch.nn.Module, mesh, state: dict) -> Path:
    state = {"step": 1, "aliases": tied_aliases(model), **state}
    save_checkpoint(run / "checkpoints", 1, model_pieces(model, mesh), mesh=mesh, state=state, rank_state={})
    return run


def _export(run: Path, out: Path, capsys) -> None:
    rc = cli_main(["export", str(run), "--format", "hf", "--out", str(out)])
    captured = capsys.readouterr()
    assert rc == 0, captured.err


def _byte_run(tmp_path: Path, mesh) -> Path:
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    return _saved_run(tmp_path / "run", GPT(cfg), mesh,
                      {"config": {"model": cfg.to_dict(), "data": {"path": "", "format": "auto"}}})


@pytest.mark.parametrize("without_tokenizers", [False, True], ids=["tokenizers", "no-tokenizers"])
def test_byte_level_run_exports_a_tokenizer_of_its_bytes(one_rank_mesh, tmp_path, capsys, monkeypatch,
                                                         without_tokenizers):
    run = _byte_run(tmp_path, one_rank_mesh)
    out = tmp_path / "hf"
    with monkeypatch.context() as m:
        if without_tokenizers:  # the export writes the tokenizer.json itself: `import tokenizers` must not be needed
            m.setitem(sys.modules, "tokenizers", None)
        _export(run, out, capsys)
    config = json.loads((out / "config.json").read_text())
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # bytes have no special tokens
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id is None
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = tok(TEXT)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))  # the byte-level encoding: one id per UTF-8 byte
    assert tok.decode(ids) == TEXT
    rc = cli_main(["generate", str(out), "--prompt", TEXT, "--max-new-tokens", "3", "--seed", "0", "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["prompt_tokens"] == list(TEXT.encode("utf-8"))


def test_llama_export_keeps_the_source_models_special_tokens(one_rank_mesh, tmp_path, capsys):
    source = tmp_path / "source"
    source.mkdir()
    raw = json.loads((EXAMPLES / "tiny-llama.json").read_text())
    raw.update(bos_token_id=5, eos_token_id=0, pad_token_id=3)  # not LlamaConfig's defaults (1, 2, None)
    (source / "config.json").write_text(json.dumps(raw))
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "temperature": 0.7}))
    bpe_tokenizer().save(str(source / "tokenizer.json"))  # the source's tokenizer: not what this run trained on
    hf_config = load_hf_config(source / "config.json")
    torch.manual_seed(0)
    model = Llama(hf_config, 32)
    state = {"config": {"model": {"hf_config": str(source / "config.json"), "pretrained": str(source),
                                  "block_size": 32}, "data": {"path": "", "format": "auto"}},
             "hf_config": hf_config.hf_dict()}
    out = tmp_path / "hf"
    _export(_saved_run(tmp_path / "run", model, one_rank_mesh, state), out, capsys)
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (5, 0, 3)
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.eos_token_id, gen.bos_token_id, gen.temperature) == (0, 5, 0.7)
    # the run trained on bytes (data.path ""): its export encodes bytes, as `shardwise generate RUN` does
    assert transformers.AutoTokenizer.from_pretrained(out)(TEXT)["input_ids"] == list(TEXT.encode("utf-8"))


def test_prepared_run_exports_the_datasets_eos_and_tokenizer(one_rank_mesh, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    bpe = bpe_tokenizer()
    bpe.save(str(data / "tokenizer.json"))
    eos = bpe.token_to_id("<eos>")
    (data / "dataset.json").write_text(json.dumps({"eos_id": eos}))
    cfg = GPTConfig(vocab_size=300, block_size=32, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    run = _saved_run(tmp_path / "run", GPT(cfg), one_rank_mesh,
                     {"config": {"model": cfg.to_dict(), "data": {"path": str(data), "format": "auto"}}})
    out = tmp_path / "hf"
    _export(run, out, capsys)
    loaded = transformers.AutoConfig.from_pretrained(out)
    assert (loaded.bos_token_id, loaded.eos_token_id) == (eos, eos)  # the document separator; GPT-2's convention
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == eos
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok(TEXT)["input_ids"] == bpe.encode(TEXT).ids and tok.eos_token == "<eos>"
