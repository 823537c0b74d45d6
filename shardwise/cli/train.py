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
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..checkpoint.sharded import CHECKPOINTS, Checkpoint, latest_checkpoint
from ..runtime.config import (PRESETS, Config, default_nproc, describe_fields, load_config,
                               read_config_file, validate)
from ..runtime.calibration import calibration_note, check_calibration_setting
from ..runtime.model_build import model_run_name
from ..runtime.job import LAUNCH_CONFIG, Nodes, atomic_json, launch_ranks, publish_config, run_job
from ..runtime.memory_check import check_memory
from ..runtime.run_lock import RunLock
from .train_resume import (check_layout_fits, check_resume, layout_text, resume_checkpoint, resume_config,
                           resume_dir, schedule_note)

__all__ = ["add_arguments", "main", "prepare", "launch", "write_config", "publish_config", "add_config_arguments",
           "config_overrides", "train_config"]

_HIDDEN = ("debug.",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR|CKPT",
                        help="continue from the latest checkpoint of RUN_DIR (default: the configured run dir), "
                             "in whatever layout the flags now ask for")
    parser.add_argument("--overwrite", action="store_true", help="start afresh in a run dir that holds checkpoints")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes in the job; parallel.nproc is the world size, "
                        "nproc / nnodes ranks per node (default 1)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's index, 0 .. nnodes-1 (multi-node)")
    parser.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT",
                        help="node 0's address and a free port, the same on every node (multi-node)")
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


def train_config(args: argparse.Namespace, overrides: dict[str, Any]) -> Config:
    """The config of ``--config``, ``--preset`` and the dotted flags. A run whose model comes from files and that
    is not named (no ``train.name`` flag or config-file key) is named after them (``model_run_name``: the
    ``--model.pretrained`` directory's name, the ``--model.hf_config`` file's), not after the GPT preset."""
    cfg = load_config(path=args.config, preset=args.preset, overrides=overrides)
    name = model_run_name(cfg.model)
    if name and not _name_given(args, overrides):
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, name=name))
    return cfg


def _name_given(args: argparse.Namespace, overrides: dict[str, Any]) -> bool:
    if "train.name" in overrides:
        return True
    tree = read_config_file(args.config) if args.config else {}  # load_config has read it: it exists and parses
    return isinstance(tree.get("train"), dict) and "name" in tree["train"]


def prepare(args: argparse.Namespace, locks: ExitStack | None = None) -> tuple[Config, Path, Path | None]:
    """(validated config, run directory, checkpoint to resume or None); writes the launch config.
    Raises ``ValueError`` for every user mistake, before anything is written or started (a resume's config is
    checked against the checkpoint first: a failed command leaves the run directory as it was). With ``locks``
    the run directory's lock (``runtime/run_lock.py``) is taken into it as soon as the directory is known (node
    0 only): a directory another command is writing is refused before anything else."""
    overrides = config_overrides(args)
    nodes = Nodes.from_args(args)
    resume: Path | None = None
    before: Config | None = None
    if args.resume is not None:
        run_dir = resume_dir(args, lambda: train_config(args, overrides).run_dir())
        _lock(locks, run_dir, nodes)
        resume = resume_checkpoint(args, run_dir)
        cfg, before = resume_config(overrides, run_dir, resume)
    else:
        cfg = train_config(args, overrides)
        run_dir = cfg.run_dir()
        _lock(locks, run_dir, nodes)
    if nodes.count > 1 and cfg.parallel.nproc == 0:  # the default is per node: one per GPU, or 2 CPU ranks
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, nproc=default_nproc() * nodes.count))
    if before is not None and resume is not None and not cfg.parallel.auto:
        check_layout_fits(before.parallel, cfg.parallel, overrides, resume)
    if cfg.parallel.auto:
        from ..runtime.planning import auto_layout

        cfg, lines = auto_layout(cfg, overrides, device="cuda" if _cuda() else "cpu",
                                 nproc=cfg.parallel.nproc or default_nproc())
        print("\n".join(lines), flush=True)
    cfg = _validate(cfg, before, resume)
    nodes.check(cfg)
    if resume is not None:
        check_resume(cfg, resume)
    # ranks (and a later --resume from another directory) read the data by absolute path
    absolute = {key: str(Path(getattr(cfg.data, key)).resolve()) for key in ("path", "val_path")
                if getattr(cfg.data, key)}
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **absolute))
    _check_data(cfg)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel,
                                                                calibration=check_calibration_setting(cfg.parallel)))
    check_memory(cfg, device="cuda" if _cuda() else "cpu", nproc=nodes.per_node(cfg))  # train.memory_check
    if resume is None and nodes.leader and latest_checkpoint(run_dir) is not None:
        if not args.overwrite:
            raise ValueError(f"run directory {str(run_dir)!r} already holds checkpoints; continue it with --resume, "
                             f"start over with --overwrite, or pick another --train.name")
        for sub in (CHECKPOINTS, "ranks", "tensorboard"):
            shutil.rmtree(run_dir / sub, ignore_errors=True)
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    write_config(cfg, run_dir, publish=resume is None and nodes.leader, clear_ranks=nodes.leader)
    note = schedule_note(before, cfg, Checkpoint(resume).step) if before is not None and resume is not None else ""
    if note:
        print(note, flush=True)
    return cfg, run_dir, resume


def _lock(locks: ExitStack | None, run_dir: Path, nodes: Nodes) -> None:
    if locks is not None and nodes.leader:  # node 0 owns the run directory (the other nodes share it)
        locks.enter_context(RunLock(run_dir, prog="shardwise train"))


def _validate(cfg: Config, before: Config | None, resume: Path | None) -> Config:
    """``validate``; on a resume a layout error also names the saved layout the new one was carried over from."""
    try:  # a resumed run's micro-batch not given now is derived again, at most the saved one
        return validate(cfg, **({"micro_cap": before.parallel.micro_batch} if before and before.parallel.micro_batch
                                else {}))
    except ValueError as exc:
        if before is None or "parallel." not in str(exc):
            raise
        raise ValueError(f"{exc} (resuming {resume}: the saved layout is {layout_text(before.parallel)}; the layout "
                         f"fields not given now are kept from it)") from None


def write_config(cfg: Config, run_dir: Path, *, publish: bool = True, clear_ranks: bool = True) -> None:
    """Create ``run_dir`` and (atomically) the launch config ``LAUNCH_CONFIG`` that every rank reads; with
    ``publish`` also the run's ``config.json`` (a resume publishes it only once it has saved a checkpoint:
    ``publish_config``). ``clear_ranks`` empties ``RUN/ranks`` (node 0 only: the other nodes' ranks share it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if clear_ranks:
        shutil.rmtree(run_dir / "ranks", ignore_errors=True)
    atomic_json(run_dir / LAUNCH_CONFIG, cfg.to_dict())
    if publish:
        publish_config(cfg, run_dir)


def _check_data(cfg: Config) -> None:
    from ..data.sources import check_data

    check_data(cfg)


def launch(cfg: Config, run_dir: Path, resume: Path | None, *, save: bool = True) -> int:
    """Start ``parallel.nproc`` local ranks running the trainer once (no restarts); the launcher's exit code."""
    return launch_ranks(cfg, run_dir, resume, save=save)


def _header(cfg: Config, run_dir: Path, resume: Path | None) -> str:
    p = cfg.parallel
    where = "GPU" if _cuda() else "CPU"
    start = f", resuming {resume}" if resume else ""
    mesh = (f"pp={p.pp} × " if p.pp > 1 else "") + f"dp={p.dp} × " + (f"cp={p.cp} × " if p.cp > 1 else "") + f"tp={p.tp}"
    stages = (f"; pipeline {p.pp_schedule}, {p.pp_microbatches} micro-batches of {p.micro_batch // p.pp_microbatches}"
              f"{f', {p.pp_chunks} chunks per rank' if p.pp_chunks > 1 else ''} per pass" if p.pp > 1 else "")
    m = cfg.model
    model = Path(m.hf_config).name if m.hf_config else f"{m.n_layer} layers × {m.n_embd} wide"
    return (f"shardwise train: {cfg.train.name} ({model}) on {p.nproc} {where} process{'es' * (p.nproc > 1)}, "
            f"mesh {mesh}"
            f"{f', ZeRO-{p.zero_stage}' if p.zero_stage else ''}; global batch {cfg.data.global_batch} = "
            f"{p.micro_batch} × {p.grad_accum} × {p.dp} (micro × accum × dp) × {cfg.model.block_size} tokens"
            f"{stages}; {cfg.train.steps} steps → {run_dir}{start}")


def _prediction(cfg: Config, run_dir: Path, resume: Path | None, nodes: Nodes) -> dict[str, Any] | None:
    """Predict the step (``runtime/prediction.py``), print it in one line and write its record to
    ``metrics.jsonl``; a prediction that fails is one line on stderr and never stops the run."""
    try:
        from ..runtime.metrics import append_record
        from ..runtime.prediction import predict_launch, prediction_line, prediction_record

        pred, where = predict_launch(cfg, device="cuda" if _cuda() else "cpu", nproc=nodes.per_node(cfg))
        step = Checkpoint(resume).step if resume is not None else 0
        record = prediction_record(pred, where, step=step)
        append_record(run_dir, record, truncate_after=step)
    except Exception as exc:  # noqa: BLE001 - the prediction is advice; training goes on without it
        print(f"shardwise train: prediction skipped: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr,
              flush=True)
        return None
    print(prediction_line(record), flush=True)
    return record


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(args: argparse.Namespace) -> int:
    with ExitStack() as locks:  # the run directory's lock, released however the command ends
        try:
            cfg, run_dir, resume = prepare(args, locks)
        except ValueError as exc:
            print(f"shardwise train: error: {exc}", file=sys.stderr)
            return 2
        return _train(args, cfg, run_dir, resume)


def _warmup_warning(cfg: Config) -> str:
    """One line when the warm-up does not end within the run: the learning rate never reaches optimizer.lr."""
    from ..runtime.step_support import lr_at

    o, steps = cfg.optimizer, cfg.train.steps
    if not o.warmup_steps or o.warmup_steps < steps or o.lr == 0:
        return ""
    return (f"shardwise train: warning: optimizer.warmup_steps = {o.warmup_steps} >= train.steps = {steps}: the "
            f"learning rate rises the whole run, to {lr_at(steps, o, steps):.3g} at the last step, and never reaches "
            f"optimizer.lr = {o.lr:g}; e.g. --optimizer.warmup_steps {steps // 10}")


def _train(args: argparse.Namespace, cfg: Config, run_dir: Path, resume: Path | None) -> int:
    print(_header(cfg, run_dir, resume), flush=True)
    note = calibration_note(cfg.parallel, "cuda" if _cuda() else "cpu", cfg.parallel.nproc)
    if note:
        print(note, flush=True)
    warmup = _warmup_warning(cfg)
    if warmup:
        print(warmup, file=sys.stderr, flush=True)
    if cfg.train.ckpt_every == 0:
        print(f"shardwise train: warning: train.ckpt_every = 0: the only checkpoint is the final one (step "
              f"{cfg.train.steps}); a failure before it loses all progress; e.g. --train.ckpt_every 100",
              file=sys.stderr, flush=True)
    nodes = Nodes.from_args(args)
    prediction = _prediction(cfg, run_dir, resume, nodes) if nodes.leader else None
    rc = run_job(cfg, run_dir, resume, nodes)
    if rc != 0:
        return rc
    if nodes.leader:
        from ..runtime.metrics import append_record, print_summary

        record = print_summary(cfg, run_dir, prediction)
        if record is not None:
            append_record(run_dir, record)
    else:
        print(f"shardwise train: node {nodes.rank} finished; node 0 prints the summary")
    return 0
