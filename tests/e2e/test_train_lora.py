"""``shardwise train --model.pretrained DIR --lora.*`` end to end: LoRA on a Hugging Face Llama trains to the same
losses in every layout, leaves the pretrained base bit-identical, starts from a PEFT adapter directory with peft's
own first loss, resumes in another layout, and refuses bad settings in one line before launching.

The pretrained directory, the adapter and the layouts' runs are the session's (``lora_runs.py``), shared with
``test_export_peft.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from shardwise.cli.export import consolidate
from tests.e2e.lora_runs import BLOCK, PATTERN, TRAIN, LoraRuns, train
from tests.e2e.runs import cli, losses, resume_in_layout

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")



@pytest.fixture(scope="module")
def dirs(lora_runs: LoraRuns) -> dict[str, Path]:
    return lora_runs.dirs


def _train(dirs: dict[str, Path], name: str, *extra: str) -> Path:
    return train(dirs, name, *extra)


@pytest.fixture(scope="module")
def one(lora_runs: LoraRuns) -> Path:
    return lora_runs.run("one")


def test_one_process_trains_the_adapters_only(dirs, one):
    state, _ = consolidate(one / "checkpoints" / "step_000006")
    base = safetensors_torch.load_file(str(dirs["llama"] / "model.safetensors"))
    adapters = [k for k in state if ".lora_" in k]
    assert len(adapters) == 2 * 3 * 2  # A and B of 3 targets in 2 layers
    for key, value in base.items():  # every pretrained tensor, under base_layer where LoRA wraps it
        name = key if key in state else key.replace(".weight", ".base_layer.weight")
        assert torch.equal(state[name], value), key
    assert all(state[k].abs().max() > 0 for k in adapters if ".lora_B." in k)  # B moved off its zero start
    run = losses(one)
    assert run[6] < run[1]


@pytest.mark.parametrize("layout", ["tp2", "zero3", "pp2"])
def test_every_layout_trains_like_one_process(lora_runs, one, layout):
    got, want = losses(lora_runs.run(layout)), losses(one)
    assert sorted(got) == sorted(want)
    for step in want:
        assert math.isclose(got[step], want[step], rel_tol=1e-5), (layout, step, got[step], want[step])


def test_resume_in_another_layout(dirs, one, tmp_path):
    resume_in_layout(one, tmp_path, ["--parallel.nproc", "2", "--parallel.tp", "2"])


def test_lora_init_starts_from_peft_adapter(dirs):
    run = _train(dirs, "init", "--lora.init", str(dirs["adapter"]), "--lora.r", "0", "--parallel.nproc", "2",
                 "--parallel.tp", "2")
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs["llama"]).float().eval()
    model = peft.PeftModel.from_pretrained(base, dirs["adapter"]).eval()
    window = torch.tensor(list(PATTERN * 2), dtype=torch.int64)[:BLOCK + 1]
    with torch.no_grad():
        logits = model(input_ids=window[None, :-1]).logits
    want = float(torch.nn.functional.cross_entropy(logits[0], window[1:]))
    assert math.isclose(losses(run)[1], want, rel_tol=1e-5), (losses(run)[1], want)


@pytest.mark.parametrize("flags, message", [
    (["--lora.targets", "qq_proj"], "LoRA target 'qq_proj' matches no nn.Linear module"),
    (["--lora.r", "-1"], "lora.r = -1 must be >= 0"),
    (["--lora.r", "0", "--lora.dropout", "0.1"], "is set but lora.r = 0 (LoRA off)"),
    (["--lora.alpha", "0"], "LoRA alpha must be > 0"),
])
def test_bad_lora_settings_are_one_line(dirs, tmp_path, flags, message):
    proc = cli(tmp_path, "train", "--model.pretrained", str(dirs["llama"]), "--data.path", str(dirs["data"]),
               *TRAIN, *flags)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_adapter_of_another_base_is_refused(dirs, tmp_path):
    torch.manual_seed(2)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64))
    peft.get_peft_model(other, peft.LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(tmp_path / "a")
    proc = cli(tmp_path, "train", "--model.pretrained", str(dirs["llama"]), "--data.path", str(dirs["data"]),
               *TRAIN[:-6], "--lora.init", str(tmp_path / "a"), "--parallel.nproc", "1")
    assert proc.returncode == 2 and "another base or another architecture" in proc.stderr, proc.stderr[-2000:]
    assert len(proc.stderr.strip().splitlines()) == 1


def test_generate_runs_the_adapted_model(dirs, one, tmp_path):
    # greedy decoding from the LoRA run (adapters unmerged) and from its merged Hugging Face export agree
    merged = tmp_path / "merged"
    proc = cli(tmp_path, "export", str(one), "--format", "hf", "--merge-lora", "--out", str(merged))
    assert proc.returncode == 0, proc.stderr[-2000:]
    texts = []
    for source in (one, merged):
        proc = cli(tmp_path, "generate", str(source), "--prompt", "hijk", "--max-new-tokens", "12", "--top-k", "1")
        assert proc.returncode == 0, proc.stderr[-2000:]
        texts.append(proc.stdout)
    assert texts[0] == texts[1] and len(texts[0].strip()) >= len("hijk")


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_data_with_lora_masks_documents_in_every_layout(tmp_path):
    # chat records rendered with a ChatML template (loss on the answers), packed with document masking (on by
    # default for such data), LoRA on a pretrained Llama: one process and tp 2 agree; the mask changes the loss
    # (windows of 64 tokens hold parts of two or three conversations of about 33)
    import json

    from shardwise.data.toy_tokenizer import train_bpe

    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    (tmp_path / "words.txt").write_text("alpha beta gamma delta omega rho sigma pi answer question\n" * 20)
    train_bpe([tmp_path / "words.txt"], 280, tmp_path / "bpe.json")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "bpe.json"))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHATML}))
    words = "alpha beta gamma delta omega rho sigma pi".split()
    records = [{"messages": [{"role": "user", "content": f"{words[i % 8]} question {words[(i * 3) % 8]}"},
                             {"role": "assistant", "content": " ".join(words[(i + j) % 8] for j in range(1 + i % 4))}]}
               for i in range(200)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    proc = cli(tmp_path, "prepare", str(tmp_path / "chat.jsonl"), "--sft", "--tokenizer", str(tok_dir), "--out",
               str(tmp_path / "data"), "--val-fraction", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=tok.get_vocab_size(), max_position_embeddings=64, initializer_range=0.5,  # attention matters
    )).save_pretrained(tmp_path / "base")
    runs = {}
    for name, extra in (("one", ["--parallel.nproc", "1"]), ("tp2", ["--parallel.nproc", "2", "--parallel.tp", "2"]),
                        ("nomask", ["--parallel.nproc", "1", "--data.document_mask", "false"])):
        proc = cli(tmp_path, "train", "--model.pretrained", str(tmp_path / "base"), "--data.path",
                   str(tmp_path / "data"), "--model.block_size", "64", "--train.steps", "2", "--train.name", name,
                   "--data.global_batch", "4", "--lora.r", "4", "--lora.targets", "q_proj,v_proj",
                   "--train.memory_check", "false", *extra)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        runs[name] = losses(tmp_path / "runs" / name)
    for step in (1, 2):
        assert math.isclose(runs["tp2"][step], runs["one"][step], rel_tol=1e-5), (step, runs)
    assert not math.isclose(runs["nomask"][1], runs["one"][1], rel_tol=1e-4), runs
