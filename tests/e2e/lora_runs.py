"""LoRA runs shared by the e2e modules that train or export them (``test_train_lora.py``, ``test_export_peft.py``):
a random transformers Llama saved as a pretrained directory, a peft adapter for it, and ``shardwise train --lora.*``
runs in several layouts, each trained once per session (``conftest.py``'s ``lora_runs``).

The data is a text whose every training window is the same (a block_size-periodic stream), so the batch of step 1
is known without reproducing the sampler.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.e2e.runs import cli

BLOCK = 16
PATTERN = bytes((7 * i + 3) % 26 + 97 for i in range(BLOCK))
TARGETS = "q_proj,v_proj,down_proj"
TRAIN = ["--model.block_size", str(BLOCK), "--train.steps", "6", "--train.ckpt_every", "3", "--optimizer.lr", "1e-2",
         "--data.global_batch", "4", "--parallel.micro_batch", "1", "--train.memory_check", "false",
         "--lora.r", "4", "--lora.alpha", "8", "--lora.targets", TARGETS]
LAYOUTS = {"one": ["--parallel.nproc", "1"],
           "tp2": ["--parallel.nproc", "2", "--parallel.tp", "2"],
           "zero3": ["--parallel.nproc", "2", "--parallel.zero_stage", "3"],
           "pp2": ["--parallel.nproc", "2", "--parallel.pp", "2", "--parallel.micro_batch", "2",
                   "--parallel.pp_microbatches", "2"]}


def make_dirs(root: Path) -> dict[str, Path]:
    """``llama`` (the pretrained directory), ``adapter`` (peft's own adapter for it, B drawn so that the adapted
    model differs from the base), ``data`` (the periodic text)."""
    import peft
    import transformers

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False))
    llama.save_pretrained(root / "llama")
    torch.manual_seed(1)
    adapted = peft.get_peft_model(llama, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS.split(","),
                                                         init_lora_weights=False))
    adapted.save_pretrained(root / "adapter")
    (root / "data.txt").write_bytes(PATTERN * 200)
    return {"llama": root / "llama", "adapter": root / "adapter", "data": root / "data.txt", "root": root}


def train(dirs: dict[str, Path], name: str, *extra: str) -> Path:
    """``shardwise train`` of LoRA on ``dirs``'s Llama (``TRAIN`` + ``extra``); the run directory."""
    proc = cli(dirs["root"], "train", "--model.pretrained", str(dirs["llama"]), "--data.path", str(dirs["data"]),
               "--train.name", name, *TRAIN, *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dirs["root"] / "runs" / name


class LoraRuns:
    """The session's shared directories and its ``LAYOUTS`` runs, each trained on first use."""

    def __init__(self, root: Path) -> None:
        self.dirs = make_dirs(root)
        self._runs: dict[str, Path] = {}

    def run(self, layout: str) -> Path:
        if layout not in self._runs:
            self._runs[layout] = train(self.dirs, layout, *LAYOUTS[layout])
        return self._runs[layout]
