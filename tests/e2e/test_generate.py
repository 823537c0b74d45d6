"""``shardwise generate`` on runs of ``shardwise train``: a run trained in two layouts (dp=2, tp=2) continues a prompt
exactly as the one-process run of the same config does (greedy and seeded sampling), a damaged latest checkpoint
falls back to the previous intact one, a prepared dataset's tokenizer is found (and copied by ``shardwise export
--format hf``), a Llama-family run generates what ``transformers`` computes from its export. Training runs as a
user would (a subprocess per run); generation in this process."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from shardwise import cli as sw_cli
from tests.e2e.generate_dirs import word_tokenizer
from tests.e2e.runs import cli

TINY = ["--data.global_batch", "8", "--parallel.micro_batch", "4", "--optimizer.warmup_steps", "2",
        "--optimizer.lr", "0.02", "--optimizer.min_lr", "0.01", "--train.steps", "6", "--train.ckpt_every", "3",
        "--train.log_every", "3"]
LAYOUTS = {"one": ["--parallel.nproc", "1"], "dp2": ["--parallel.nproc", "2"],
           "tp2": ["--parallel.nproc", "2", "--parallel.tp", "2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same tiny GPT trained 6 steps (checkpoints at 3 and 6) in each layout."""
    cwd = tmp_path_factory.mktemp("gen")
    for name, layout in LAYOUTS.items():
        proc = cli(cwd, "train", *TINY, *layout, "--train.name", name)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {name: cwd / "runs" / name for name in LAYOUTS}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops one token at a time; identical numbers on both sides of every comparison
    yield
    torch.set_num_threads(before)


def generate(path: Path, capsys, *flags: str, json_out: bool = True) -> tuple[dict | str, str]:
    argv = ["generate", str(path), "--prompt", "The quick ", "--device", "cpu", *flags]
    rc = sw_cli.main(argv + (["--json"] if json_out else []))
    out, err = capsys.readouterr()
    assert rc == 0, err
    return (json.loads(out) if json_out else out), err


def test_every_layout_continues_a_prompt_as_one_process_does(runs, capsys):
    greedy = {n: generate(p, capsys, "--temperature", "0", "--max-new-tokens", "40")[0] for n, p in runs.items()}
    sampled = {n: generate(p, capsys, "--seed", "3", "--max-new-tokens", "40")[0] for n, p in runs.items()}
    for name in ("dp2", "tp2"):
        assert greedy[name]["tokens"] == greedy["one"]["tokens"], name
        assert sampled[name]["tokens"] == sampled["one"]["tokens"], name  # a draw reads every logit, not the max
    assert greedy["one"]["prompt_tokens"] == list(b"The quick ")  # the byte tokenizer of the generated corpus
    assert len(sampled["one"]["tokens"]) == 40 and len(set(sampled["one"]["tokens"])) > 5
    # the loaded models agree logit for logit (to float noise: the layouts summed in other orders)
    from shardwise.cli.generate_load import find_source, load_weights, meta_model_of

    seq = torch.tensor([greedy["one"]["prompt_tokens"] + sampled["one"]["tokens"]])
    logits = {}
    for name, path in runs.items():
        src = find_source(str(path))
        assert src.path.name == "step_000006"
        with torch.no_grad():
            logits[name] = load_weights(meta_model_of(src), src, torch.device("cpu"))(seq)
    for name in ("dp2", "tp2"):
        torch.testing.assert_close(logits[name], logits["one"], rtol=1e-4, atol=1e-4)


def test_text_output_and_a_damaged_latest_checkpoint(runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["one"], run)
    text, err = generate(run, capsys, "--temperature", "0", "--max-new-tokens", "12", json_out=False)
    assert text.startswith("The quick ") and len(text.rstrip("\n")) >= len("The quick ") + 1
    assert "12 tokens in" in err and "tokens/s" in err
    want = generate(run / "checkpoints" / "step_000003", capsys, "--seed", "1", "--max-new-tokens", "20")[0]
    piece = run / "checkpoints" / "step_000006" / "rank00000.safetensors"
    data = bytearray(piece.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])  # flip the last values' bits: the checksum no longer matches
    piece.write_bytes(bytes(data))
    got, err = generate(run, capsys, "--seed", "1", "--max-new-tokens", "20")
    assert "warning: skipped checkpoint" in err and "step_000006" in err and "checksum" in err
    assert got["tokens"] == want["tokens"]  # the step-3 model, found by the fallback


def _with_prepared_data(run: Path, data: Path) -> None:
    """Point ``run``'s checkpoints at ``data`` as their prepared dataset (``data.path``), as a run trained on
    ``shardwise prepare``'s output records it (only the JSON state changes; tensors keep their checksums)."""
    for index in run.glob("checkpoints/step_*/index.json"):
        raw = json.loads(index.read_text())
        raw["state"]["config"]["data"]["path"] = str(data)
        index.write_text(json.dumps(raw))


def test_prepared_dataset_tokenizer_is_used_and_exported(runs, tmp_path, capsys):
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(runs["one"], run)
    data.mkdir()
    words = ["<unk>", "The", "quick", "brown", "fox"] + [f"w{i}" for i in range(40)]
    word_tokenizer(words).save(str(data / "tokenizer.json"))
    _with_prepared_data(run, data)
    free, _ = generate(run, capsys, "--seed", "2", "--max-new-tokens", "30")
    assert free["prompt_tokens"] == [1, 2]  # words, not bytes: the dataset's tokenizer
    assert len(free["tokens"]) == 30
    eos = free["tokens"][5]
    (data / "dataset.json").write_text(json.dumps({"eos_id": eos}))  # now the dataset names an EOS
    stopped, err = generate(run, capsys, "--seed", "2", "--max-new-tokens", "30")
    assert stopped["tokens"] == free["tokens"][:free["tokens"].index(eos) + 1] and "stopped at EOS" in err
    out = tmp_path / "hf"
    proc = cli(tmp_path, "export", str(run), "--format", "hf", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()
    assert "+ 1 tokenizer files" in proc.stdout  # tokenizer.json only: dataset.json is not a tokenizer file


def test_missing_tokenizers_package_is_one_line(tmp_path, monkeypatch, capsys):
    from tests.e2e.generate_dirs import gpt2_dir

    gpt2_dir(tmp_path / "m", vocab=16, positions=16, tokenizer=word_tokenizer(["a", "b"]))
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)  # import tokenizers -> ImportError
    assert sw_cli.main(["generate", str(tmp_path / "m"), "--prompt", "a"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'pip install "shardwise[data]"' in err and "tokenizers package" in err


def test_a_llama_run_generates_what_transformers_computes_from_its_export(tmp_path, capsys):
    """A Llama-family run (``--model.hf_config``, trained in tp=2) → ``shardwise generate RUN``; the same checkpoint
    exported with ``--format hf`` and loaded by ``transformers``: same greedy tokens, same logits."""
    transformers = pytest.importorskip("transformers")
    config = Path(__file__).resolve().parents[2] / "examples" / "hf" / "tiny-llama.json"
    proc = cli(tmp_path, "train", "--model.hf_config", str(config), *TINY, *LAYOUTS["tp2"], "--train.name", "llama")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "llama"
    greedy = generate(run, capsys, "--temperature", "0", "--max-new-tokens", "30")[0]
    sampled = generate(run, capsys, "--seed", "4", "--max-new-tokens", "30")[0]
    proc = cli(tmp_path, "export", str(run), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert proc.returncode == 0, proc.stderr
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model.generation_config.eos_token_id = None  # a byte-level run has no EOS
    prompt = torch.tensor([greedy["prompt_tokens"]])
    with torch.no_grad():
        want = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=30, do_sample=False,
                              pad_token_id=0)[0, prompt.size(1):].tolist()
        seq = torch.tensor([sampled["prompt_tokens"] + sampled["tokens"]])
        theirs = model(seq).logits
    assert greedy["tokens"] == want
    from shardwise.cli.generate_load import find_source, load_weights, meta_model_of

    src = find_source(str(run))
    with torch.no_grad():
        ours = load_weights(meta_model_of(src), src, torch.device("cpu"))(seq)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
