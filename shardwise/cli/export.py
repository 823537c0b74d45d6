"""``shardwise export RUN_DIR|CKPT --out model.safetensors``: one consolidated file with the plain model's keys.

Reads the sharded checkpoint (any layout it was saved in), assembles every model tensor in full, restores
tied keys (``lm_head.weight`` next to ``wte.weight``) and writes a single safetensors file whose keys are
exactly those of ``GPT(config).state_dict()``; the model config is stored in the file's metadata. A LoRA run's keys
are written as trained (``<module>.base_layer.weight``, ``<module>.lora_A.weight``, ``<module>.lora_B.weight``: the
state dict of the model after ``sw.apply_lora``; the run's ``lora`` section is the ``lora_config`` metadata
entry); a frozen base the checkpoint left out (``train.save_frozen = false``) is read from the run's
``model.pretrained`` directory. A model trained
from a Hugging Face config (``model.hf_config``) exports HF's keys (``model.layers.0.self_attn.q_proj.weight``,
..., ``lm_head.weight``) and its architecture as the ``hf_config`` metadata entry (a ``config.json`` object):
``transformers`` loads the file with ``load_state_dict`` into the model of that config.

The checkpoint is verified first (``verify_checkpoint``: every piece present, confined, readable, of the
indexed shape and checksum) and a non-finite model tensor is refused. The output is written to a temporary
file beside ``--out`` and moved over it with ``os.replace``, so a failed export leaves no partial file and an
existing ``--out`` untouched. Every failure is one line on stderr (``shardwise export: error: ...``), exit 2.

``--format hf --out DIR`` writes a Hugging Face model directory instead (``shardwise.checkpoint.hf_dir``):
``config.json``, safetensors shards of at most ``--max-shard-mb`` with their index (or one
``model.safetensors``), GPT-2's keys and layout for a reference-GPT run, HF's own for a ``model.hf_config`` run,
the special token ids (``config.json`` and ``generation_config.json``) and the tokenizer files of the run's
prepared dataset, of the run directory or of the pretrained directory the run started from — or, for a byte-level
run, a ``tokenizer.json`` of that byte encoding (``export_tokens.py``). Tensors are read and written one at a
time; ``DIR`` is replaced atomically (docs/training.md, "Pretrained weights in and out"). A LoRA run needs
``--merge-lora`` there (each adapter folded into its base weight); ``--format peft --out DIR`` writes its adapters
alone as a PEFT adapter directory (``export_peft.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError

from ..checkpoint.export_view import OMITTED_STATE, ExportView
from ..checkpoint.hf_dir import check_out_dir, hf_export, write_hf_dir
from ..checkpoint.sharded import Checkpoint, resolve_checkpoint, verify_checkpoint
from .export_tokens import data_kind, generated_tokenizer_files, generation_config, special_ids

__all__ = ["add_arguments", "main", "consolidate", "write_atomic", "export_hf", "tokenizer_files", "prepared_dir",
           "TOKENIZER_FILES"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "chat_template.jinja")
"""Copied into an ``--format hf`` export from the first directory holding any of them."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="run directory (its latest checkpoint) or a checkpoint directory")
    parser.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                        help="safetensors: one file with the plain model's keys (default; a LoRA run's keys as "
                             "trained); hf: a Hugging Face model directory (config.json, shards, index, tokenizer "
                             "files) that from_pretrained loads; peft: a LoRA run's adapters as a PEFT adapter "
                             "directory that peft.PeftModel.from_pretrained loads onto the base")
    parser.add_argument("--merge-lora", action="store_true",
                        help="--format hf of a LoRA run: fold each adapter into its base weight (W + scaling·B·A) "
                             "and write the merged model")
    parser.add_argument("--out", default=None,
                        help="output file (--format safetensors, default model.safetensors) or directory (--format hf, "
                             "required; an existing model directory is replaced)")
    parser.add_argument("--max-shard-mb", type=float, default=5000.0,
                        help="--format hf: the size limit of one safetensors shard in MB (default 5000)")


def consolidate(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(plain-model state dict with full tensors, metadata) of a checkpoint, verified first. Reads files only.
    Raises ``CheckpointError`` for a damaged checkpoint, ``ValueError`` for a non-finite model tensor."""
    where = resolve_checkpoint(path)
    verify_checkpoint(where)
    ckpt = Checkpoint(where)
    # a frozen base left out of the checkpoint (train.save_frozen = false) is read from model.pretrained
    view = ExportView(ckpt) if ckpt.state.get(OMITTED_STATE) else ckpt
    out: dict[str, torch.Tensor] = {}
    for key in view.keys("model/"):
        t = view.full(key).contiguous()
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
    if any(".lora_A." in k for k in out):  # the LoRA setup that rebuilds the model these keys load into
        meta["lora_config"] = json.dumps(ckpt.state.get("config", {}).get("lora", {}))
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


def prepared_dir(state: dict) -> Path | None:
    """The prepared dataset directory (``shardwise prepare``'s output: ``dataset.json``, ``tokenizer.json``) a
    checkpoint's run trained on — its ``data.path`` when that is a directory — or None."""
    config = state.get("config")
    data = config.get("data") if isinstance(config, dict) else None
    path = data.get("path") if isinstance(data, dict) else None
    if isinstance(path, str) and path and Path(path).expanduser().is_dir():
        return Path(path).expanduser()
    return None


def tokenizer_files(ckpt: Checkpoint) -> list[Path]:
    """The tokenizer files of the first of: the run's prepared dataset directory (``data.path``), the run
    directory, the run's ``model.pretrained`` directory, the directory of its ``model.hf_config`` — that holds any
    (files of two tokenizers are never mixed). A byte-level run looks in the first two only, as ``shardwise
    generate`` does: its tokens are bytes whatever tokenizer the source model came with."""
    model = ckpt.state.get("config", {}).get("model", {}) if isinstance(ckpt.state.get("config"), dict) else {}
    prepared = prepared_dir(ckpt.state)
    places = [prepared] if prepared is not None else []
    places += [ckpt.path.parent.parent] if ckpt.path.parent.name == "checkpoints" else []
    for field, parent in (("pretrained", False), ("hf_config", True)) if data_kind(ckpt.state) != "bytes" else ():
        value = model.get(field) if isinstance(model, dict) else None
        if isinstance(value, str) and value:
            places.append(Path(value).expanduser().parent if parent else Path(value).expanduser())
    for place in places:
        found = [place / name for name in TOKENIZER_FILES if (place / name).is_file()]
        if found:
            return found
    return []


def export_hf(path: str | Path, out: Path, max_shard_bytes: int, *,
              merge_lora: bool = False) -> tuple[int, int, int, list[Path], list[str]]:
    """Write the checkpoint at ``path`` as a Hugging Face model directory ``out`` (``merge_lora``: a LoRA run's
    adapters folded into their base weights); returns (step, tensors, values, tokenizer files copied, names of the
    files written from the run's tokens: ``generation_config.json``, a byte-level ``tokenizer.json``...). Raises
    what the reading and writing raise (one-line messages)."""
    check_out_dir(out)  # before anything is read or written
    where = resolve_checkpoint(path)
    verify_checkpoint(where)
    ckpt = Checkpoint(where)
    config, tensors = hf_export(ckpt, merge_lora=merge_lora)
    counted = {"tensors": 0, "values": 0}

    def counting() -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in tensors:
            counted["tensors"] += 1
            counted["values"] += t.numel()
            yield name, t
            del t

    config.update(special_ids(ckpt.state))  # the tokens the run trained with, not the architecture's defaults
    for key in ("bos_token_id", "eos_token_id"):
        config.setdefault(key, None)
    extra = tokenizer_files(ckpt)
    context = config.get("max_position_embeddings") or config.get("n_positions")
    written = {"generation_config.json": generation_config(ckpt.state, config),
               **generated_tokenizer_files(ckpt.state, extra, config, context)}
    write_hf_dir(counting(), config, out, max_shard_bytes=max_shard_bytes, extra_files=extra, extra_json=written)
    return ckpt.step, counted["tensors"], counted["values"], extra, sorted(written)


def _main_hf(args: argparse.Namespace) -> int:
    if not args.out:
        return _error("--format hf needs --out DIR (the model directory to write)")
    if not args.max_shard_mb > 0:
        return _error(f"--max-shard-mb {args.max_shard_mb} must be positive")
    out = Path(args.out)
    try:
        step, n, values, extra, written = export_hf(args.path, out, int(args.max_shard_mb * 1e6),
                                                    merge_lora=bool(getattr(args, "merge_lora", False)))
    except (ValueError, TypeError, SafetensorError) as exc:  # CheckpointError is a ValueError
        return _error(exc)
    except OSError as exc:
        where = exc.filename or out
        return _error(f"{where}: {exc.strerror or exc}; --out must be a writable directory path and the checkpoint "
                      f"readable")
    tok = (f" + {len(extra)} tokenizer files" if extra else "") + f" + {', '.join(written)}"
    merged = ", LoRA merged" if getattr(args, "merge_lora", False) else ""
    print(f"shardwise export: {n} tensors ({values:,} values) of step {step}{tok} → {out} (Hugging Face "
          f"directory{merged})")
    return 0


def main(args: argparse.Namespace) -> int:
    kind = getattr(args, "format", "safetensors")
    if getattr(args, "merge_lora", False) and kind != "hf":
        return _error(f"--merge-lora writes a merged Hugging Face directory: pass it with --format hf, not --format "
                      f"{kind}")
    if kind == "hf":
        return _main_hf(args)
    if kind == "peft":
        from .export_peft import main_peft

        return main_peft(args, _error)
    try:
        tensors, meta = consolidate(args.path)
    except (ValueError, OSError, SafetensorError) as exc:  # CheckpointError is a ValueError
        return _error(exc)
    out = Path(args.out or "model.safetensors")
    try:
        write_atomic(tensors, meta, out)
    except (OSError, SafetensorError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        return _error(f"cannot write --out {str(out)!r} ({detail}); pass a writable file path (not a directory)")
    n = sum(t.numel() for t in tensors.values())
    print(f"shardwise export: {len(tensors)} tensors ({n:,} values) of step {meta['step']} → {out}")
    return 0
