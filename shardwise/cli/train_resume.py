"""``shardwise train --resume``: which run and checkpoint, the config it continues under, and what changes.

A resume continues the config saved in its checkpoint with this command's dotted overrides. The model is
rebuilt from the checkpoint alone (``model_build.resumable_model``: a ``--model.pretrained`` directory or an
``--model.hf_config`` file may be gone). The layout fields not given now are carried over, and a carried-over
layout that no longer fits the processes is refused in one line showing the saved layout, the new one and the
fix. A different ``train.steps`` reshapes the cosine schedule, which is said in one line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Callable

from ..checkpoint.sharded import CHECKPOINTS, Checkpoint, CheckpointError, latest_intact_checkpoint, verify_checkpoint
from ..runtime.config import Config, DebugConfig, ParallelConfig, config_from_dict, default_nproc, load_config
from ..runtime.model_build import model_mismatch, resumable_model

__all__ = ["resume_dir", "resume_checkpoint", "resume_config", "relayout", "check_layout_fits", "check_resume",
           "layout_text", "schedule_note", "HF_COPY"]

HF_COPY = "hf_config.json"
"""``RUN/hf_config.json``: the architecture a resume restores from its checkpoint when the run's HF config file
is gone."""


def _is_checkpoint(path: str) -> bool:
    return bool(path) and (Path(path) / "index.json").is_file()


def resume_dir(args: argparse.Namespace, default_run_dir: Callable[[], Path]) -> Path:
    """The run directory ``--resume [RUN_DIR|CKPT]`` continues (a checkpoint's run is two levels up); one line
    naming the runs next to it when it does not exist."""
    if _is_checkpoint(args.resume):
        return Path(args.resume).parent.parent
    run_dir = Path(args.resume) if args.resume else default_run_dir()
    if not run_dir.is_dir():
        raise ValueError(f"--resume: no such run directory: {str(run_dir)!r} ({_runs_near(run_dir)}); pass one of "
                         f"them, or start a fresh run without --resume")
    return run_dir


def _runs_near(run_dir: Path) -> str:
    parent = run_dir.parent
    runs = sorted(p.name for p in parent.iterdir() if p.is_dir() and ((p / CHECKPOINTS).is_dir()
                                                                          or (p / "config.json").is_file())) \
        if parent.is_dir() else []
    if not runs:
        return f"no runs in {str(parent)!r}"
    more = f", … ({len(runs)} in all)" if len(runs) > 8 else ""
    return f"runs in {str(parent)!r}: {', '.join(runs[:8])}{more}"


def resume_checkpoint(args: argparse.Namespace, run_dir: Path) -> Path:
    """A checkpoint directory given explicitly must be intact; from a run directory the newest intact checkpoint
    is taken, with a warning for every newer one that is damaged."""
    if _is_checkpoint(args.resume):
        try:
            verify_checkpoint(Path(args.resume))
        except CheckpointError as exc:
            raise ValueError(f"--resume {args.resume}: {exc}") from None
        return Path(args.resume)
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
    return ckpt


def resume_config(overrides: dict[str, Any], run_dir: Path, ckpt: Path) -> tuple[Config, Config]:
    """(the config to resume under, the saved one). The saved config is the one stored in the checkpoint (the
    run's config.json for old checkpoints), its model made self-contained (``resumable_model``); this command's
    dotted overrides apply on top. Fault injection (``debug.*``) belongs to one invocation: not inherited."""
    state = Checkpoint(ckpt).state
    tree = state.get("config") or json.loads((run_dir / "config.json").read_text())
    if "model" in tree:
        tree = {**tree, "model": resumable_model(tree["model"], state.get("hf_config"), run_dir / HF_COPY)}
    before = config_from_dict(tree)
    cfg = load_config(base=dataclasses.replace(before, debug=DebugConfig()), overrides=overrides)
    cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, out_dir=str(run_dir)),
                              parallel=relayout(before.parallel, cfg.parallel, overrides))
    return cfg, before


def relayout(saved: ParallelConfig, new: ParallelConfig, overrides: dict[str, Any]) -> ParallelConfig:
    """The resumed layout: sizes the saved run inferred (dp, grad_accum, nproc, pp_microbatches) are inferred
    afresh unless given now, and so is micro_batch, up to the saved one (``validate``'s ``micro_cap``; the global
    batch stays the saved one); a new pp drops the saved stage boundaries (and chunks, at pp = 1) unless given."""
    def given(key: str, default: Any) -> Any:
        return overrides.get(f"parallel.{key}", default)

    keep = new.pp == saved.pp
    return dataclasses.replace(new, dp=int(given("dp", 0)), grad_accum=int(given("grad_accum", 0)),
                               nproc=int(given("nproc", 0)), pp_microbatches=int(given("pp_microbatches", 0)),
                               micro_batch=int(given("micro_batch", 0)),
                               pp_split=new.pp_split if keep or "parallel.pp_split" in overrides else (),
                               pp_chunks=new.pp_chunks if new.pp > 1 or "parallel.pp_chunks" in overrides else 1)


def layout_text(p: ParallelConfig, nproc: int | None = None) -> str:
    """``dp 1 × tp 2 × pp 1 × cp 1, ZeRO-0 on 2 processes`` (dp '?' where it is still to be inferred)."""
    n = p.nproc if nproc is None else nproc
    return (f"dp {p.dp or '?'} × tp {p.tp} × pp {p.pp} × cp {p.cp}, ZeRO-{p.zero_stage} on {n} "
            f"process{'es' * (n != 1)}")


def check_layout_fits(saved: ParallelConfig, new: ParallelConfig, overrides: dict[str, Any], ckpt: Path) -> None:
    """When dp is to be inferred but the axes kept from the saved run and given now do not divide the processes,
    refuse in one line: the saved layout, the new one, and what to pass (a kept axis at 1, or more processes)."""
    nproc = new.nproc or default_nproc()
    per_replica = new.tp * new.pp * new.cp
    if new.dp or nproc % per_replica == 0:
        return
    kept = [a for a in ("tp", "pp", "cp") if f"parallel.{a}" not in overrides and getattr(new, a) > 1]
    fixes = []
    for axis in kept:
        rest = per_replica // getattr(new, axis)
        if nproc % rest == 0:
            trial = dataclasses.replace(new, **{axis: 1}, dp=nproc // rest)
            fixes.append(f"--parallel.{axis} 1 ({layout_text(trial, nproc)})")
    fixes.append(f"--parallel.nproc {per_replica} ({layout_text(dataclasses.replace(new, dp=1), per_replica)})")
    origin = f" (kept from the saved run: {', '.join(f'{a} {getattr(new, a)}' for a in kept)})" if kept else ""
    raise ValueError(f"--resume {ckpt}: the saved layout is {layout_text(saved)}; the new one asks tp {new.tp} × "
                     f"pp {new.pp} × cp {new.cp} = {per_replica} processes per replica{origin}, which does not "
                     f"divide parallel.nproc = {nproc}; pass " + " or ".join(fixes))


def check_resume(cfg: Config, resume: Path) -> None:
    """The checkpoint holds the same model (``model_mismatch``) and is short of ``train.steps``."""
    ckpt = Checkpoint(resume)
    saved = ckpt.state.get("config", {}).get("model")
    diff = model_mismatch(saved, ckpt.state.get("hf_config"), cfg.model) if saved is not None else {}
    if diff:
        raise ValueError(f"--resume: checkpoint {resume} was trained with a different model: "
                         + ", ".join(f"{k} = {new!r} (saved {old!r})" for k, (old, new) in diff.items())
                         + "; resume with the saved model config (drop the model.* overrides), or start a new run")
    if ckpt.step >= cfg.train.steps:
        saved_steps = ckpt.state.get("config", {}).get("train", {}).get("steps")
        done = " (the run finished)" if saved_steps == ckpt.step else ""
        raise ValueError(f"--resume: {resume} is at step {ckpt.step} and train.steps = {cfg.train.steps}{done}: "
                         f"nothing left to train; pass --train.steps N with N > {ckpt.step} to continue, e.g. "
                         f"--train.steps {2 * ckpt.step}")


def schedule_note(before: Config, cfg: Config, step: int) -> str:
    """One line when the resumed ``train.steps`` differs from the saved run's under a cosine schedule: the
    schedule is recomputed over the new total, so the learning rate from the next step on changes."""
    from ..runtime.step_support import lr_at

    old, new = before.train.steps, cfg.train.steps
    if old == new or cfg.optimizer.schedule != "cosine":
        return ""
    was, now = lr_at(step + 1, before.optimizer, old), lr_at(step + 1, cfg.optimizer, new)
    return (f"shardwise train: note: train.steps {old} → {new} on resume from step {step}: the cosine schedule now "
            f"decays to optimizer.min_lr at step {new} (was {old}); the learning rate of step {step + 1} is "
            f"{now:.3g} (the saved schedule's: {was:.3g})")
