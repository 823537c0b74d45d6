"""``shardwise export RUN --format peft --out DIR``: a LoRA run's adapters as a PEFT adapter directory.

``DIR`` gets ``adapter_config.json`` (r, lora_alpha, target_modules, lora_dropout, use_rslora of the run's
``lora`` section; ``base_model_name_or_path`` = its ``model.pretrained``) and ``adapter_model.safetensors``
(``base_model.model.<module>.lora_A.weight`` (r, in) / ``lora_B.weight`` (out, r), fp32 as trained), written
atomically; ``peft.PeftModel.from_pretrained(base, DIR)`` loads it onto the base model
(``shardwise.checkpoint.peft_adapter``). Only the adapters are read from the checkpoint, not the base.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

from safetensors import SafetensorError

from ..checkpoint.export_view import checkpoint_adapter
from ..checkpoint.peft_adapter import write_peft_dir
from ..checkpoint.sharded import Checkpoint, resolve_checkpoint, verify_checkpoint

__all__ = ["main_peft", "export_peft"]


def export_peft(path: str | Path, out: Path) -> tuple[int, int, int, dict]:
    """Write the adapters of the checkpoint at ``path`` (a run directory: its latest) as the PEFT adapter directory
    ``out``; returns (step, tensors, values, adapter config). One-line ValueError for a run without adapters,
    a damaged checkpoint or an ``out`` that is not an adapter directory to replace."""
    where = resolve_checkpoint(path)
    verify_checkpoint(where)
    ckpt = Checkpoint(where)
    config, tensors = checkpoint_adapter(ckpt)
    write_peft_dir(out, tensors, config)
    return ckpt.step, len(tensors), sum(t.numel() for t in tensors.values()), config


def main_peft(args: argparse.Namespace, error: Callable[[object], int]) -> int:
    """The ``--format peft`` branch of ``shardwise export`` (``error`` prints the one-line failure, returns 2)."""
    if not args.out:
        return error("--format peft needs --out DIR (the adapter directory to write)")
    out = Path(args.out)
    try:
        step, n, values, config = export_peft(args.path, out)
    except (ValueError, TypeError, SafetensorError) as exc:  # CheckpointError is a ValueError
        return error(exc)
    except OSError as exc:
        return error(f"{exc.filename or out}: {exc.strerror or exc}; --out must be a writable directory path and the "
                     f"checkpoint readable")
    targets = ",".join(config["target_modules"])
    print(f"shardwise export: {n} adapter tensors ({values:,} values, r={config['r']}, "
          f"lora_alpha={config['lora_alpha']:g}, targets {targets}) of step {step} → {out} (PEFT adapter directory)")
    return 0
