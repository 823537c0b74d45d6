"""``shardwise export RUN_DIR|CKPT --out model.safetensors``: one consolidated file with the plain model's keys.

Reads the sharded checkpoint (any layout it was saved in), assembles every model tensor in full, restores
tied keys (``lm_head.weight`` next to ``wte.weight``) and writes a single safetensors file whose keys are
exactly those of ``GPT(config).state_dict()``; the model config is stored in the file's metadata. A model trained
from a Hugging Face config (``model.hf_config``) exports HF's keys (``model.layers.0.self_attn.q_proj.weight``,
..., ``lm_head.weight``) and its architecture as the ``hf_config`` metadata entry (a ``config.json`` object):
``transformers`` loads the file with ``load_state_dict`` into the model of that config.

The checkpoint is verified first (``verify_checkpoint``: every piece present, confined, readable, of the
indexed shape and checksum) and a non-finite model tensor is refused. The output is written to a temporary
file beside ``--out`` and moved over it with ``os.replace``, so a failed export leaves no partial file and an
existing ``--out`` untouched. Every failure is one line on stderr (``shardwise export: error: ...``), exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError

from ..checkpoint.sharded import Checkpoint, resolve_checkpoint, verify_checkpoint

__all__ = ["add_arguments", "main", "consolidate", "write_atomic"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="run directory (its latest checkpoint) or a checkpoint directory")
    parser.add_argument("--out", default="model.safetensors", help="output file (default model.safetensors)")


def consolidate(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(plain-model state dict with full tensors, metadata) of a checkpoint, verified first. Reads files only.
    Raises ``CheckpointError`` for a damaged checkpoint, ``ValueError`` for a non-finite model tensor."""
    where = resolve_checkpoint(path)
    verify_checkpoint(where)
    ckpt = Checkpoint(where)
    out: dict[str, torch.Tensor] = {}
    for key in ckpt.keys("model/"):
        t = ckpt.full(key).contiguous()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"checkpoint {ckpt.path}: {key!r} holds NaN/Inf values; refusing to export a diverged "
                             f"model; export an earlier checkpoint (pass its directory, e.g. "
                             f"{ckpt.path.parent}/step_NNNNNN)")
        out[key[len("model/"):]] = t
    for alias, original in ckpt.state.get("aliases", {}).items():
        out[alias] = out[original].clone()  # safetensors stores no shared storage: a tied key gets a copy
    meta = {"format": "shardwise-export-v1", "step": str(ckpt.step),
            "model_config": json.dumps(ckpt.state.get("config", {}).get("model", {}))}
    if "hf_config" in ckpt.state:  # model.hf_config: the keys are HF's; this rebuilds the HF model to load them into
        meta["hf_config"] = json.dumps(ckpt.state["hf_config"])
    return out, meta


def write_atomic(tensors: dict[str, torch.Tensor], meta: dict[str, str], out: Path) -> None:
    """``save_file`` to a temporary file in ``out``'s directory, fsync, then ``os.replace`` onto ``out``."""
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    try:
        save_file(tensors, str(tmp), metadata=meta)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def _error(text: object) -> int:
    print("shardwise export: error: " + " ".join(str(text).split()), file=sys.stderr)
    return 2


def main(args: argparse.Namespace) -> int:
    try:
        tensors, meta = consolidate(args.path)
    except (ValueError, OSError, SafetensorError) as exc:  # CheckpointError is a ValueError
        return _error(exc)
    out = Path(args.out)
    try:
        write_atomic(tensors, meta, out)
    except (OSError, SafetensorError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return _error(f"cannot write --out {str(out)!r} ({detail}); pass a writable file path (not a directory)")
    n = sum(t.numel() for t in tensors.values())
    print(f"shardwise export: {len(tensors)} tensors ({n:,} values) of step {meta['step']} → {out}")
    return 0
