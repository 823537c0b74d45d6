"""The launcher's side of ``shardwise train``: start the ranks (one node or several), supervise them, report a
failure, and restart from the newest intact checkpoint (``train.max_restarts``).

Files in the run directory that this module manages::

    launch.json     the config of the current launch (every rank reads it; rewritten by each command)
    config.json     the run's config, published only by a fresh start or a launch that saved a checkpoint,
                    so a command that fails changes nothing a user relies on
    ranks/          per-rank step, error, summary and ``.killed`` files of the current attempt

and one it does not: ``.lock``, held by the command (``cli/train.py``, ``run_lock.RunLock``) from before the first
launch until after the last restart, so that no other command writes the run meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.sharded import Checkpoint, latest_checkpoint, latest_intact_checkpoint
from .config import Config
from .launch import run_local
from .supervisor import RankSupervisor

__all__ = ["LAUNCH_CONFIG", "KILL_GRACE_S", "Nodes", "launch_ranks", "run_job", "publish_config", "atomic_json"]

LAUNCH_CONFIG = "launch.json"
KILL_GRACE_S = 3.0
"""Once a rank has ended, the others get this long to end too before they are killed (``RankSupervisor``)."""


def atomic_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` through a temporary file and ``os.replace``: readers see old or new, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def publish_config(cfg: Config, run_dir: Path) -> None:
    """Replace ``RUN/config.json`` with ``cfg`` (informational: a resume reads the config stored in the checkpoint
    it continues)."""
    atomic_json(run_dir / "config.json", cfg.to_dict())


@dataclass(frozen=True)
class Nodes:
    """Where this launcher sits in a multi-node job (``--nnodes/--node-rank/--rdzv-endpoint``)."""

    count: int = 1
    rank: int = 0
    endpoint: str | None = None

    @property
    def leader(self) -> bool:
        """Node 0 owns the run directory's shared files (clears ``ranks/``, publishes ``config.json``)."""
        return self.rank == 0

    @staticmethod
    def from_args(args: argparse.Namespace) -> "Nodes":
        count, rank, endpoint = getattr(args, "nnodes", 1), getattr(args, "node_rank", 0), getattr(args, "rdzv_endpoint", None)
        if count < 1:
            raise ValueError(f"--nnodes {count} must be >= 1")
        if not 0 <= rank < count:
            raise ValueError(f"--node-rank {rank} must be in 0..{count - 1} for --nnodes {count}")
        if count > 1 and not endpoint:
            raise ValueError(f"--nnodes {count} needs --rdzv-endpoint HOST:PORT (node 0's address and a free port, "
                             f"the same on every node)")
        if endpoint is not None:
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--rdzv-endpoint {endpoint!r} must be HOST:PORT, e.g. node0.example:29500")
        return Nodes(count, rank, endpoint)

    def check(self, cfg: Config) -> None:
        """The layout fits the nodes: the world size splits evenly; restarts are single-node only."""
        nproc = cfg.parallel.nproc
        if nproc % self.count:
            raise ValueError(f"parallel.nproc = {nproc} (the world size) must be a multiple of --nnodes {self.count}; "
                             f"use --parallel.nproc {self.count * max(1, nproc // self.count)}")
        if self.count > 1 and cfg.train.max_restarts:
            raise ValueError(f"train.max_restarts = {cfg.train.max_restarts} with --nnodes {self.count} is not "
                             f"supported: restart a multi-node job with your scheduler and --resume; use "
                             f"--train.max_restarts 0")

    def per_node(self, cfg: Config) -> int:
        return cfg.parallel.nproc // self.count


def launch_ranks(cfg: Config, run_dir: Path, resume: Path | None, *, save: bool = True, nodes: Nodes = Nodes(),
                 attempt: int = 0) -> int:
    """Start this node's ranks running the trainer on ``RUN/launch.json`` and wait for them, killing any rank
    that outlives a failure by ``KILL_GRACE_S``; returns the launcher's exit code."""
    target = ["shardwise.runtime.trainer", "--run-dir", str(run_dir), "--config", str(run_dir / LAUNCH_CONFIG),
              "--attempt", str(attempt)]
    if resume is not None:
        target += ["--resume", str(resume)]
    if not save:
        target.append("--no-save")
    multi, codes = nodes.count > 1, {}
    with RankSupervisor(grace_s=KILL_GRACE_S, marker_dir=run_dir / "ranks"):
        rc = run_local(nodes.per_node(cfg), target, module=True, nnodes=str(nodes.count) if multi else None,
                       node_rank=nodes.rank if multi else None, rdzv_endpoint=nodes.endpoint if multi else None,
                       exit_codes=codes, report_interrupt=False)  # run_job's failure report says it
    for rank, code in codes.items():  # read by failure_report: who died by its own fault, who was stopped
        (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
        (run_dir / "ranks" / f"rank{rank:05d}.exit").write_text(f"{code}\n")
    return rc


def run_job(cfg: Config, run_dir: Path, resume: Path | None, nodes: Nodes = Nodes()) -> int:
    """Launch, and after a failure restart up to ``train.max_restarts`` times from the newest intact checkpoint
    (the same losses as an uninterrupted run: a resume restores weights, optimizer, data position and RNG).
    Prints each failure's report; returns the last attempt's exit code (130 when interrupted)."""
    from .metrics import failure_report

    attempt = 0
    while True:
        before = latest_checkpoint(run_dir)
        rc = launch_ranks(cfg, run_dir, resume, nodes=nodes, attempt=attempt)
        if nodes.leader and (rc == 0 or latest_checkpoint(run_dir) != before):
            publish_config(cfg, run_dir)
        if rc == 0:
            return 0
        print(failure_report(run_dir, rc, cfg), file=sys.stderr, flush=True)
        if rc == 130 or any((run_dir / "ranks").glob("rank*.interrupted")):  # Ctrl-C: never a restart
            return 130
        why_not = _no_restart(cfg, run_dir, attempt)
        if why_not:
            if cfg.train.max_restarts:
                print(f"shardwise train: not restarting: {why_not}", file=sys.stderr, flush=True)
            return rc
        attempt += 1
        resume = _restart_point(run_dir)
        if resume is not None and Checkpoint(resume).step >= cfg.train.steps:
            return rc  # the failure came after the final checkpoint: nothing is left to train
        shutil.rmtree(run_dir / "ranks", ignore_errors=True)
        print(f"shardwise train: restart {attempt}/{cfg.train.max_restarts}: resuming from "
              f"{resume or 'the beginning (no intact checkpoint yet)'}", file=sys.stderr, flush=True)


def _no_restart(cfg: Config, run_dir: Path, attempt: int) -> str:
    if attempt >= cfg.train.max_restarts:
        return f"train.max_restarts = {cfg.train.max_restarts} used up" if cfg.train.max_restarts else "off"
    errors = [p.read_text() for p in (run_dir / "ranks").glob("rank*.error")]
    if any("NonFiniteError" in e for e in errors):
        return "a non-finite loss or gradient would recur at the same step"
    return ""


def _restart_point(run_dir: Path) -> Path | None:
    ckpt, skipped = latest_intact_checkpoint(run_dir)
    for bad, reason in skipped:
        print(f"shardwise train: warning: skipping damaged checkpoint {bad}: {reason}", file=sys.stderr, flush=True)
    return ckpt

