"""What an unknown command-line option probably meant: ``suggest("--steps", options)`` → ``"--train.steps"``.

Options are never abbreviated (the parsers are built with ``allow_abbrev=False``: ``--parallel.zero 3`` must not
quietly mean ``--parallel.zero_stage 3``), so an unknown option is an error line with, where one is likely, the
option the user meant. In this order: the usual spellings of other tools (``--lr``, ``--batch-size``, ``-n``,
``--resume-from`` …, ``ALIASES``); an option the given one abbreviates; a config field of that name in any section
(``--micro_batch`` → ``--parallel.micro_batch``); a close spelling (difflib). Only options the command has are
suggested. Pure.
"""

from __future__ import annotations

import difflib
from typing import Iterable

__all__ = ["ALIASES", "suggest"]

ALIASES: dict[str, str] = {
    "lr": "--optimizer.lr", "learning-rate": "--optimizer.lr", "batch-size": "--data.global_batch",
    "bs": "--data.global_batch", "global-batch-size": "--data.global_batch", "micro-batch-size":
    "--parallel.micro_batch", "mbs": "--parallel.micro_batch", "n": "--parallel.nproc", "nproc-per-node":
    "--parallel.nproc", "gpus": "--parallel.nproc", "num-gpus": "--parallel.nproc", "devices": "--parallel.nproc",
    "world-size": "--parallel.nproc", "zero": "--parallel.zero_stage", "accum": "--parallel.grad_accum",
    "gradient-accumulation-steps": "--parallel.grad_accum", "name": "--train.name", "run-name": "--train.name",
    "out": "--train.out_dir", "output-dir": "--train.out_dir", "max-steps": "--train.steps",
    "iters": "--train.steps", "bf16": "--train.precision bf16", "fp32": "--train.precision fp32",
    "resume-from": "--resume", "resume-from-checkpoint": "--resume", "restore": "--resume", "continue": "--resume",
    "checkpoint": "--resume", "warmup": "--optimizer.warmup_steps", "seq-len": "--model.block_size",
    "seq-length": "--model.block_size", "context-length": "--model.block_size", "layers": "--model.n_layer",
    "num-layers": "--model.n_layer", "heads": "--model.n_head", "hidden-size": "--model.n_embd",
    "grad-clip": "--optimizer.clip_grad_norm", "clip-grad": "--optimizer.clip_grad_norm",
    "schedule": "--parallel.pp_schedule", "microbatches": "--parallel.pp_microbatches", "dataset": "--data.path",
    "train-data": "--data.path", "val-data": "--data.val_path", "toml": "--config",
}
"""Other tools' spellings (normalized: lower case, no leading dashes, ``_`` as ``-``) → ours (with a value where
the option is a value of ours)."""


def _norm(option: str) -> str:
    return option.lstrip("-").lower().replace("_", "-")


def suggest(given: str, options: Iterable[str]) -> str:
    """The option(s) ``given`` (an unknown option, without ``=VALUE``) probably meant, e.g. ``--train.steps`` or
    ``--optimizer.name or --train.name``; ``""`` when nothing is close."""
    options = sorted(set(options))
    alias = ALIASES.get(_norm(given))
    if alias and alias.split()[0] in options:
        return alias
    longs = [o for o in options if o.startswith("--")]
    if given.startswith("--") and len(given) > 3:
        longer = [o for o in longs if o.startswith(given)]  # an abbreviation: never accepted, named in full
        if 0 < len(longer) <= 3:
            return " or ".join(longer)
    field = _norm(given)
    named = [o for o in longs if "." in o and _norm(o.partition(".")[2]) == field]
    if named:
        return " or ".join(named[:3])
    close = difflib.get_close_matches(given, [o for o in options if o.startswith("--") or len(given) == 2], n=1,
                                      cutoff=0.75)
    return close[0] if close else ""
