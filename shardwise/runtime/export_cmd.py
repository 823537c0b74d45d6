"""``shardwise export RUN_DIR|CKPT --out model.safetensors``: one consolidated file with the plain model's keys.

Reads the sharded checkpoint (any layout it was saved in), assembles every model tensor in full, restores
tied keys (``lm_head.weight`` next to ``wte.weight``) and writes a single safetensors file whose keys are
exactly those of ``GPT(config).state_dict()``; the model config is stored in the file's metadata.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from ..checkpoint.sharded import Checkpoint

__all__ = ["add_arguments", "main", "consolidate"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="run directory (its latest checkpoint) or a checkpoint directory")
    parser.add_argument("--out", default="model.safetensors", help="output file (default model.safetensors)")


def consolidate(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(plain-model state dict with full tensors, metadata) of a checkpoint. Reads files only."""
    ckpt = Checkpoint(path)
    out = {key[len("model/"):]: ckpt.full(key).contiguous() for key in ckpt.keys("model/")}
    for alias, original in ckpt.state.get("aliases", {}).items():
        out[alias] = out[original].clone()  # safetensors stores no shared storage: a tied key gets a copy
    meta = {"format": "shardwise-export-v1", "step": str(ckpt.step),
            "model_config": json.dumps(ckpt.state.get("config", {}).get("model", {}))}
    return out, meta


def main(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    try:
        tensors, meta = consolidate(args.path)
    except ValueError as exc:
        print(f"shardwise export: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata=meta)
    n = sum(t.numel() for t in tensors.values())
    print(f"shardwise export: {len(tensors)} tensors ({n:,} values) of step {meta['step']} → {out}")
    return 0
