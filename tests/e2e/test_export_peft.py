"""``shardwise export`` of a LoRA run end to end: ``--format peft`` writes an adapter directory that
``peft.PeftModel.from_pretrained(base, DIR)`` loads onto the run's ``--model.pretrained`` base with logits equal to
the run's model (relative 1e-5, fp32), ``--format hf --merge-lora`` a directory ``transformers`` loads with the same
logits; both also for runs in tp 2 and ZeRO-3 (dp 2), for a run that left its frozen base out of the checkpoint
(``--train.save_frozen false``) and for the reference GPT from a GPT-2 directory (adapters under GPT-2's names, ``fan_in_fan_out``). The run's model is
rebuilt independently: our model + ``apply_lora`` + the checkpoint's tensors.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.e2e.runs import cli

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BLOCK = 16
TEXT = bytes((7 * i + 3) % 26 + 97 for i in range(4 * BLOCK)) * 50
TRAIN = ["--train.steps", "2", "--optimizer.lr", "0.05", "--optimizer.warmup_steps", "0", "--data.global_batch", "2",
         "--parallel.micro_batch", "1", "--train.memory_check", "false", "--parallel.nproc", "1",
         "--model.block_size", str(BLOCK), "--train.ckpt_every", "2"]
LORA = ["--lora.r", "4", "--lora.alpha", "8"]
IDS = torch.tensor([list(TEXT[:BLOCK]), list(TEXT[5:5 + BLOCK])], dtype=torch.int64)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora_export")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)).save_pretrained(root / "llama")
    transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=BLOCK, activation_function="gelu")).save_pretrained(root / "gpt2")
    (root / "data.txt").write_bytes(TEXT)
    return root


def _train(root: Path, name: str, base: str, *extra: str) -> Path:
    run = root / "runs" / name
    if not run.is_dir():
        proc = cli(root, "train", "--model.pretrained", str(root / base), "--data.path", str(root / "data.txt"),
                   "--train.name", name, *TRAIN, *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run


SHARED = {"llama": "one", "llama-tp2": "tp2", "llama-zero3": "zero3"}
"""Runs of the session's ``lora_runs`` (``lora_runs.py``: the same targets, trained once for this module and
test_train_lora.py) standing in for this module's own."""

RUNS = {"llama": ("llama", *LORA, "--lora.targets", "q_proj,v_proj,down_proj"),
        "llama-nofrozen": ("llama", *LORA, "--lora.targets", "q_proj,v_proj,down_proj", "--train.save_frozen", "false"),
        "gpt2": ("gpt2", *LORA, "--lora.targets", "qkv,fc"),
        # adapters split with their base (tp) or flat-sharded (ZeRO-3) are saved whole, from every rank's pieces
        "llama-tp2": ("llama", *LORA, "--lora.targets", "q_proj,v_proj,down_proj", "--parallel.nproc", "2",
                      "--parallel.tp", "2"),
        "llama-zero3": ("llama", *LORA, "--lora.targets", "q_proj,v_proj,down_proj", "--parallel.nproc", "2",
                        "--parallel.zero_stage", "3")}


def _run_logits(run: Path) -> torch.Tensor:
    """The run's model rebuilt from its checkpoint: our model + apply_lora + every saved tensor (strict)."""
    from shardwise.checkpoint.sharded import Checkpoint
    from shardwise.cli.export import consolidate
    from shardwise.models.gpt import GPT, GPTConfig
    from shardwise.models.hf_config import hf_config_from_dict
    from shardwise.models.llama import Llama
    from shardwise.models.lora import LoRAConfig, apply_lora

    ckpt = Checkpoint(run)
    lora, model_cfg = ckpt.state["config"]["lora"], ckpt.state["config"]["model"]
    if "hf_config" in ckpt.state:
        model = Llama(hf_config_from_dict(ckpt.state["hf_config"]), block_size=BLOCK)
    else:
        fields = GPTConfig.__dataclass_fields__
        model = GPT(GPTConfig(**{k: v for k, v in model_cfg.items() if k in fields}))
    apply_lora(model, LoRAConfig(r=lora["r"], alpha=lora["alpha"], targets=tuple(lora["targets"].split(","))))
    state, _ = consolidate(run)  # a left-out frozen base comes from model.pretrained
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        return model.eval()(IDS)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("name", list(RUNS))
def test_peft_adapter_and_merged_model_give_the_runs_logits(root: Path, lora_runs, name: str) -> None:
    base_dir, *flags = RUNS[name]
    if name in SHARED:
        run, base = lora_runs.run(SHARED[name]), lora_runs.dirs["llama"]
    else:
        run, base = _train(root, name, base_dir, *flags), root / base_dir
    want = _run_logits(run)
    adapter, merged = root / f"adapter-{name}", root / f"merged-{name}"
    for fmt, out, extra in (("peft", adapter, []), ("hf", merged, ["--merge-lora"])):
        proc = cli(root, "export", str(run), "--format", fmt, "--out", str(out), *extra)
        assert proc.returncode == 0, proc.stderr
    pretrained = base
    base = transformers.AutoModelForCausalLM.from_pretrained(pretrained).float().eval()
    with torch.no_grad():
        plain = base(input_ids=IDS).logits
        loaded = peft.PeftModel.from_pretrained(base, adapter).eval()
        _close(loaded(input_ids=IDS).logits, want)
        _close(transformers.AutoModelForCausalLM.from_pretrained(merged).float().eval()(input_ids=IDS).logits, want)
    assert not torch.allclose(plain, want, atol=1e-4)  # the trained adapters change the model
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(pretrained) and config["r"] == 4
    assert config["fan_in_fan_out"] is (name == "gpt2")
    assert config["target_modules"] == (["c_attn", "c_fc"] if name == "gpt2" else ["down_proj", "q_proj", "v_proj"])


def test_safetensors_keeps_the_runs_keys(root: Path, lora_runs) -> None:
    from safetensors.torch import load_file

    run = lora_runs.run("one")
    proc = cli(root, "export", str(run), "--out", str(root / "lora.safetensors"))
    assert proc.returncode == 0, proc.stderr
    from safetensors import safe_open

    keys = set(load_file(str(root / "lora.safetensors")))
    with safe_open(str(root / "lora.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["lora_config"])["targets"] == "q_proj,v_proj,down_proj"
    assert {"model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.lora_A.weight",
            "model.layers.1.mlp.down_proj.lora_B.weight", "model.layers.0.self_attn.k_proj.weight"} <= keys


def _refused(root: Path, *args: str) -> str:
    proc = cli(root, "export", *args)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("shardwise export: error: "), proc.stderr
    return lines[0]


def test_lora_and_non_lora_runs_refuse_the_wrong_export(root: Path, lora_runs) -> None:
    lora = lora_runs.run("one")
    plain = _train(root, "plain", "llama")
    out = str(root / "refused")
    assert "holds LoRA adapters; pass --merge-lora" in _refused(root, str(lora), "--format", "hf", "--out", out)
    assert "--merge-lora: checkpoint" in _refused(root, str(plain), "--format", "hf", "--merge-lora", "--out", out)
    assert "holds no LoRA adapters" in _refused(root, str(plain), "--format", "peft", "--out", out)
    assert "pass it with --format hf, not --format peft" in _refused(root, str(lora), "--format", "peft",
                                                                    "--merge-lora", "--out", out)
    assert not Path(out).exists()


def test_checkpoints_that_cannot_be_exported_are_named(root: Path, lora_runs) -> None:
    """Saved states the commands cannot produce today (edited in memory): each refusal names its cause."""
    from shardwise.checkpoint.export_view import ExportView, checkpoint_adapter
    from shardwise.checkpoint.sharded import Checkpoint

    ckpt = Checkpoint(_train(root, "llama-nofrozen", *RUNS["llama-nofrozen"]))
    ckpt.state["config"]["model"]["pretrained"] = str(root / "moved-away")
    with pytest.raises(ValueError, match="its frozen base was not saved .* is not there to read it from"):
        ExportView(ckpt)
    checkpoint_adapter(ckpt)  # the adapters alone need no base
    ckpt = Checkpoint(lora_runs.run("one"))
    ckpt.state["aliases"] = {"model.layers.0.self_attn.q_proj.base_layer.weight": "model.embed_tokens.weight"}
    with pytest.raises(ValueError, match="is tied to 'model.embed_tokens.weight'; merging its adapter"):
        ExportView(ckpt, merge_lora=True)
    del ckpt.state["config"]["lora"]
    with pytest.raises(ValueError, match="holds no LoRA section with r > 0 and alpha"):
        checkpoint_adapter(ckpt)
