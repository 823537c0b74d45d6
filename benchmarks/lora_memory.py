"""LoRA on a frozen base under ZeRO-3: what a rank holds against the ledger's floor, beside full fine-tuning of the
same model in the same layout.

    python benchmarks/lora_memory.py [--nproc 4] [--layers 6] [--hidden 512] [--seq 128] [--r 8]

Writes a random Llama (transformers, no download) as a pretrained directory in a temporary folder, then runs
``shardwise train --model.pretrained DIR --parallel.zero_stage 3`` twice — LoRA on every linear layer of the blocks,
and full fine-tuning — and prints each run's floor terms (rank 0: parameters, gradients, optimizer state, gathered
units, activations, communication buffers) and its measured peak over the floor, from the summary's
``memory_ledger`` (``runtime/memory_ledger.py``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 2**20
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _model_dir(root: Path, layers: int, hidden: int) -> Path:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=256, max_position_embeddings=1024, tie_word_embeddings=False))
    model.save_pretrained(root / "base")
    (root / "data.txt").write_bytes(bytes(range(97, 123)) * 4000)
    return root / "base"


def _run(root: Path, base: Path, name: str, args: argparse.Namespace, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "shardwise.cli", "train", "--model.pretrained", str(base), "--data.path",
           str(root / "data.txt"), "--model.block_size", str(args.seq), "--train.steps", "3", "--train.name", name,
           "--parallel.nproc", str(args.nproc), "--parallel.zero_stage", "3", "--data.global_batch",
           str(2 * args.nproc), "--parallel.micro_batch", "2", *extra]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(line) for line in (root / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r.get("kind") == "summary")["memory_ledger"][0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--r", type=int, default=8)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        base = _model_dir(root, args.layers, args.hidden)
        runs = {"lora": _run(root, base, "lora", args, ["--lora.r", str(args.r), "--lora.targets", TARGETS]),
                "full": _run(root, base, "full", args, [])}
    terms = ("params", "grads", "optimizer", "gathered", "activations", "comm")
    print(f"{'run':6}" + "".join(f"{t:>13}" for t in terms) + f"{'floor':>10}{'peak':>10}{'peak/floor':>12}")
    for name, led in runs.items():
        floor = led["floor"]
        peak = led["whole_peak"] - led.get("held_on_entry", 0)
        print(f"{name:6}" + "".join(f"{floor[t] / MIB:13.2f}" for t in terms)
              + f"{floor['total'] / MIB:10.1f}{peak / MIB:10.1f}{led['ratio']:12.2f}")
        print(f"{'':6}biggest excess: {led['biggest_excess'][1]} {led['biggest_excess'][2] / MIB:.1f} MiB "
              f"({led['biggest_excess'][0]})")


if __name__ == "__main__":
    main()
