"""``shardwise train``: validate the config, start the ranks (torchrun via ``run_local``), print a summary.

    shardwise train                                   # gpt-tiny on the generated corpus, all GPUs or 2 CPU ranks
    shardwise train --preset gpt-small --parallel.tp 2 --data book.txt
    shardwise train --config run.toml --train.steps 1000
    shardwise train --resume                          # continue runs/NAME from its latest checkpoint

Everything is checked in this process before any rank starts; a bad value is one error line naming the
field, the value and the fix (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from ..checkpoint.sharded import CHECKPOINTS, Checkpoint, latest_checkpoint
from .config import PRESETS, Config, DebugConfig, ParallelConfig, describe_fields, load_config, validate
from .launch import run_local

__all__ = ["add_arguments", "main", "prepare", "launch", "write_config", "add_config_arguments", "config_overrides"]

_HIDDEN = ("debug.",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR|CKPT",
                        help="continue from the latest checkpoint of RUN_DIR (default: the configured run dir), "
                             "in whatever layout the flags now ask for")
    parser.add_argument("--overwrite", action="store_true", help="start afresh in a run dir that holds checkpoints")
    add_config_arguments(parser)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config``, ``--preset``, ``--data`` and one ``--section.field`` flag per config field."""
    parser.add_argument("--config", default=None, metavar="TOML", help="config file ([model], [data], [optimizer], "
                        "[parallel], [train] tables; optional top-level preset = NAME)")
    parser.add_argument("--preset", default=None, choices=sorted(PRESETS), help="named config bundle")
    parser.add_argument("--data", default=None, metavar="PATH", help="text file or uint16 .bin (= --data.path)")
    group = parser.add_argument_group("config fields (dotted overrides, e.g. --parallel.tp 2)")
    for key, default, doc in describe_fields():
        hidden = key.startswith(_HIDDEN)
        group.add_argument(f"--{key}", dest=f"cfg.{key}", default=argparse.SUPPRESS, metavar="V",
                           help=argparse.SUPPRESS if hidden else f"{doc} [{default}]".replace("%", "%%"))


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    out = {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg.")}
    if getattr(args, "data", None):
        out["data.path"] = args.data
    return out


def prepare(args: argparse.Namespace) -> tuple[Config, Path, Path | None]:
    """(validated config, run directory, checkpoint to resume or None); writes ``RUN/config.json``.
    Raises ``ValueError`` for every user mistake, before anything is started."""
    overrides = config_overrides(args)
    resume: Path | None = None
    if args.resume is not None:
        cfg, run_dir, resume = _resume_config(args, overrides)
    else:
        cfg = load_config(path=args.config, preset=args.preset, overrides=overrides)
        run_dir = cfg.run_dir()
    cfg = validate(cfg)
    if resume is not None and Checkpoint(resume).step >= cfg.train.steps:
        raise ValueError(f"--resume: {resume} is at step {Checkpoint(resume).step} and train.steps = "
                         f"{cfg.train.steps}: nothing left to train; pass --train.steps N with N > "
                         f"{Checkpoint(resume).step} to continue")
    if cfg.data.path:  # ranks (and a later --resume from another directory) read it by absolute path
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=str(Path(cfg.data.path).resolve())))
    _check_data(cfg)
    if resume is None and latest_checkpoint(run_dir) is not None:
        if not args.overwrite:
            raise ValueError(f"run directory {str(run_dir)!r} already holds checkpoints; continue it with --resume, "
                             f"start over with --overwrite, or pick another --train.name")
        for sub in (CHECKPOINTS, "ranks", "tensorboard"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    write_config(cfg, run_dir)
    return cfg, run_dir, resume


def write_config(cfg: Config, run_dir: Path) -> None:
    """Create ``run_dir`` and (atomically) its ``config.json``, which every rank reads; clear rank files."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / ".config.json.tmp"
    tmp.write_text(json.dumps(cfg.to_dict(), indent=1))
    os.replace(tmp, run_dir / "config.json")
    shutil.rmtree(run_dir / "ranks", ignore_errors=True)


def _resume_config(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[Config, Path, Path]:
    if args.resume:
        path = Path(args.resume)
        run_dir = path.parent.parent if (path / "index.json").is_file() else path
    else:
        run_dir = load_config(path=args.config, preset=args.preset, overrides=overrides).run_dir()
    saved = run_dir / "config.json"
    given = Path(args.resume) if args.resume else None
    ckpt = given if given is not None and (given / "index.json").is_file() else latest_checkpoint(run_dir)
    if ckpt is None or not saved.is_file():
        raise ValueError(f"--resume: no checkpoint in {str(run_dir)!r} (looked for {CHECKPOINTS}/latest and "
                         f"config.json); start a fresh run without --resume")
    # The saved run's config, with this command's dotted overrides (e.g. a new layout or more steps).
    # Fault injection (debug.*) belongs to one invocation: it is not inherited from the saved run.
    before = load_config(path=saved)
    cfg = load_config(base=dataclasses.replace(before, debug=DebugConfig()), overrides=overrides)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(run_dir)),
                              parallel=_relayout(before.parallel, cfg.parallel, overrides))
    return cfg, run_dir, ckpt


def _relayout(saved: ParallelConfig, new: ParallelConfig, overrides: dict[str, Any]) -> ParallelConfig:
    """The resumed layout: sizes the saved run inferred (dp, grad_accum, nproc, pp_microbatches) are inferred
    afresh unless given now; a new pp drops the saved stage boundaries (and chunks, at pp = 1) unless given."""
    def given(key: str, default: Any) -> Any:
        return overrides.get(f"parallel.{key}", default)

    keep = new.pp == saved.pp
    return dataclasses.replace(new, dp=int(given("dp", 0)), grad_accum=int(given("grad_accum", 0)),
                               nproc=int(given("nproc", 0)), pp_microbatches=int(given("pp_microbatches", 0)),
                               pp_split=new.pp_split if keep or "parallel.pp_split" in overrides else (),
                               pp_chunks=new.pp_chunks if new.pp > 1 or "parallel.pp_chunks" in overrides else 1)


def _check_data(cfg: Config) -> None:
    import torch

    from .corpus import load_corpus

    tokens = load_corpus(cfg.data.path, cfg.data.format)
    windows = (tokens.numel() - 1) // cfg.model.block_size
    if windows < cfg.data.global_batch:
        raise ValueError(f"data.path = {cfg.data.path!r} holds {tokens.numel()} tokens = {windows} windows of "
                         f"model.block_size={cfg.model.block_size}, fewer than one step's data.global_batch="
                         f"{cfg.data.global_batch}; use more data or a smaller global batch / block size")
    top = int(tokens.to(torch.int32).max()) if tokens.numel() else 0  # uint16 has no max kernel
    if top >= cfg.model.vocab_size:
        raise ValueError(f"data.path = {cfg.data.path!r} contains token id {top} but model.vocab_size = "
                         f"{cfg.model.vocab_size}; set --model.vocab_size {top + 1} or larger")


def launch(cfg: Config, run_dir: Path, resume: Path | None, *, save: bool = True) -> int:
    """Start ``parallel.nproc`` ranks running the trainer; returns the launcher's exit code."""
    target = ["shardwise.runtime.trainer", "--run-dir", str(run_dir)]
    if resume is not None:
        target += ["--resume", str(resume)]
    if not save:
        target.append("--no-save")
    return run_local(cfg.parallel.nproc, target, module=True)


def _header(cfg: Config, run_dir: Path, resume: Path | None) -> str:
    p = cfg.parallel
    where = "GPU" if _cuda() else "CPU"
    start = f", resuming {resume}" if resume else ""
    mesh = (f"pp={p.pp} × " if p.pp > 1 else "") + f"dp={p.dp} × tp={p.tp}"
    stages = (f"; pipeline {p.pp_schedule}, {p.pp_microbatches} micro-batches of {p.micro_batch // p.pp_microbatches}"
              f"{f', {p.pp_chunks} chunks per rank' if p.pp_chunks > 1 else ''} per pass" if p.pp > 1 else "")
    return (f"shardwise train: {cfg.train.name} on {p.nproc} {where} process{'es' * (p.nproc > 1)}, mesh {mesh}"
            f"{f', ZeRO-{p.zero_stage}' if p.zero_stage else ''}; global batch {cfg.data.global_batch} = "
            f"{p.micro_batch} × {p.grad_accum} × {p.dp} (micro × accum × dp) × {cfg.model.block_size} tokens"
            f"{stages}; {cfg.train.steps} steps → {run_dir}{start}")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(args: argparse.Namespace) -> int:
    try:
        cfg, run_dir, resume = prepare(args)
    except ValueError as exc:
        print(f"shardwise train: error: {exc}", file=sys.stderr)
        return 2
    print(_header(cfg, run_dir, resume), flush=True)
    rc = launch(cfg, run_dir, resume)
    if rc != 0:
        from .metrics import failure_report

        print(failure_report(run_dir, rc, cfg), file=sys.stderr, flush=True)
        return 130 if any((run_dir / "ranks").glob("rank*.interrupted")) else rc
    from .metrics import print_summary

    print_summary(cfg, run_dir)
    return 0
