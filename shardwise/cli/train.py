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
from pathlib import Path
from typing import Any

from ..checkpoint.sharded import (CHECKPOINTS, Checkpoint, CheckpointError, latest_checkpoint, latest_intact_checkpoint,
                                  verify_checkpoint)
from ..runtime.config import (PRESETS, Config, DebugConfig, ParallelConfig, config_from_dict, default_nproc, describe_fields,
                     load_config, validate)
from ..runtime.calibration import calibration_note, check_calibration_setting
from ..runtime.model_build import saved_model
from ..runtime.job import LAUNCH_CONFIG, Nodes, atomic_json, launch_ranks, publish_config, run_job
from ..runtime.memory_check import check_memory

__all__ = ["add_arguments", "main", "prepare", "launch", "write_config", "publish_config", "add_config_arguments",
           "config_overrides"]

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


def prepare(args: argparse.Namespace) -> tuple[Config, Path, Path | None]:
    """(validated config, run directory, checkpoint to resume or None); writes the launch config.
    Raises ``ValueError`` for every user mistake, before anything is written or started (a resume's config is
    checked against the checkpoint first: a failed command leaves the run directory as it was)."""
    overrides = config_overrides(args)
    nodes = Nodes.from_args(args)
    resume: Path | None = None
    if args.resume is not None:
        cfg, run_dir, resume = _resume_config(args, overrides)
    else:
        cfg = load_config(path=args.config, preset=args.preset, overrides=overrides)
        run_dir = cfg.run_dir()
    if nodes.count > 1 and cfg.parallel.nproc == 0:  # the default is per node: one per GPU, or 2 CPU ranks
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, nproc=default_nproc() * nodes.count))
    if cfg.parallel.auto:
        from ..runtime.planning import auto_layout

        cfg, lines = auto_layout(cfg, overrides, device="cuda" if _cuda() else "cpu",
                                 nproc=cfg.parallel.nproc or default_nproc())
        print("\n".join(lines), flush=True)
    cfg = validate(cfg)
    nodes.check(cfg)
    if resume is not None:
        _check_resume(cfg, resume)
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
    return cfg, run_dir, resume


def _check_resume(cfg: Config, resume: Path) -> None:
    ckpt = Checkpoint(resume)
    saved = ckpt.state.get("config", {}).get("model")
    saved = saved_model(saved) if saved is not None else None  # fields added later (hf_config) at their defaults
    if saved is not None and saved != dataclasses.asdict(cfg.model):
        diff = {k: (saved.get(k), v) for k, v in dataclasses.asdict(cfg.model).items() if saved.get(k) != v}
        raise ValueError(f"--resume: checkpoint {resume} was trained with a different model: "
                         + ", ".join(f"model.{k} = {new!r} (saved {old!r})" for k, (old, new) in diff.items())
                         + "; resume with the saved model config (drop the model.* overrides), or start a new run")
    if ckpt.step >= cfg.train.steps:
        raise ValueError(f"--resume: {resume} is at step {ckpt.step} and train.steps = {cfg.train.steps}: nothing "
                         f"left to train; pass --train.steps N with N > {ckpt.step} to continue")


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


def _resume_target(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[Path, Path]:
    """(run directory, checkpoint): a checkpoint directory given explicitly must be intact; from a run directory
    the newest intact checkpoint is taken, with a warning for every newer one that is damaged."""
    if args.resume and (Path(args.resume) / "index.json").is_file():
        ckpt = Path(args.resume)
        try:
            verify_checkpoint(ckpt)
        except CheckpointError as exc:
            raise ValueError(f"--resume {args.resume}: {exc}") from None
        return ckpt.parent.parent, ckpt
    run_dir = (Path(args.resume) if args.resume
               else load_config(path=args.config, preset=args.preset, overrides=overrides).run_dir())
    ckpt, skipped = latest_intact_checkpoint(run_dir)
    for bad, reason in skipped:
        print(f"shardwise train: warning: skipping damaged checkpoint {bad}: {reason}", file=sys.stderr, flush=True)
    if ckpt is None:
        found = f" ({len(skipped)} damaged, none intact)" if skipped else ""
        raise ValueError(f"--resume: no intact checkpoint in {str(run_dir)!r}{found}; start a fresh run without "
                         f"--resume (--overwrite to reuse the directory)")
    if skipped:
        print(f"shardwise train: warning: resuming from the newest intact checkpoint, {ckpt}", file=sys.stderr,
              flush=True)
    return run_dir, ckpt


def _resume_config(args: argparse.Namespace, overrides: dict[str, Any]) -> tuple[Config, Path, Path]:
    run_dir, ckpt = _resume_target(args, overrides)
    # The config that trained this checkpoint (saved inside it; the run's config.json for old checkpoints), with
    # this command's dotted overrides (e.g. a new layout or more steps). Fault injection (debug.*) belongs to one
    # invocation: it is not inherited.
    state = Checkpoint(ckpt).state.get("config")
    before = config_from_dict(state) if state else load_config(path=run_dir / "config.json")
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
    try:
        cfg, run_dir, resume = prepare(args)
    except ValueError as exc:
        print(f"shardwise train: error: {exc}", file=sys.stderr)
        return 2
    print(_header(cfg, run_dir, resume), flush=True)
    note = calibration_note(cfg.parallel, "cuda" if _cuda() else "cpu", cfg.parallel.nproc)
    if note:
        print(note, flush=True)
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
