"""Rank-side checks for the trainer's non-finite guard (run inside LocalWorld ranks by tests/dist/test_nonfinite.py).

Each layout builds the real ``Trainer`` (meshes from the per-rank cache), runs ``K+1`` steps with ``train.nonfinite =
skip`` and the loss of step ``K`` made NaN on rank 1 only, and reports per step: skipped or not, and whether this
rank's model tensors and optimizer state are bitwise those of the step before.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from shardwise.runtime import trainer as trainer_mod
from shardwise.runtime.config import load_config, validate
from shardwise.world import World
from shardwise.runtime.nonfinite import NonFiniteError
from tests.dist.meshes import mesh

K = 2

LAYOUTS: dict[str, dict[str, Any]] = {
    "dp2": {},
    "zero1": {"parallel.zero_stage": "1"},
    "zero2": {"parallel.zero_stage": "2"},
    "zero3": {"parallel.zero_stage": "3"},
    "tp2": {"parallel.tp": "2"},
    "pp2": {"parallel.pp": "2"},
}

SMALL = {"data.global_batch": "8", "parallel.micro_batch": "2", "optimizer.warmup_steps": "0",
         "model.n_layer": "2", "model.block_size": "32"}


def _state(t: trainer_mod.Trainer) -> list[torch.Tensor]:
    """This rank's model tensors and optimizer state tensors (whatever the layout), cloned."""
    if t.zero:
        tensors = [g.master.detach() for g in t.model.groups]  # stage 3 frees ``full``: the shards say it all
        tensors += [g.full.detach() for g in t.model.groups if t.model.stage < 3]
    else:
        tensors = [q.detach() for q in t.model.parameters()]
    opt = t.optimizer.state if hasattr(t.optimizer, "state") else {}
    tensors += [v for s in opt.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return [x.clone() for x in tensors]


def _build(layout: str, extra: dict[str, str], world_rank: int) -> trainer_mod.Trainer:
    overrides = {**SMALL, **LAYOUTS[layout], "parallel.nproc": "2", "train.nonfinite": "skip", **extra}
    cfg = validate(load_config(overrides=overrides))
    p = cfg.parallel
    axes = dict(pp=p.pp, dp=p.dp, tp=p.tp) if p.pp > 1 else dict(dp=p.dp, tp=p.tp)
    trainer_mod._build_mesh = lambda *_: mesh(**axes)  # the rank's cached meshes: no new process groups
    world = World(rank=world_rank, world_size=2, local_rank=world_rank, backend="gloo", device=torch.device("cpu"))
    return trainer_mod.Trainer(cfg, Path(tempfile.mkdtemp()), world)


def check_skip(layouts: list[str]) -> list[dict[str, Any]]:
    """Per layout: ``{"layout", "skipped": [per step], "same": [per step: state equals the step before's],
    "losses", "count"}``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for layout in layouts:
        t = _build(layout, {"train.steps": str(K + 1), "debug.nonfinite_step": str(K), "debug.nonfinite_rank": "1"},
                   rank)
        before = _state(t)
        skipped, same, losses = [], [], []
        for _ in range(K + 1):
            loss, _t = t.train_step()
            after = _state(t)
            skipped.append(t.last_skipped)
            same.append(len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after)))
            losses.append(loss)
            before = after
        out.append({"layout": layout, "skipped": skipped, "same": same, "losses": losses, "count": t.skipped})
    return out


def check_stop(layouts: list[str]) -> list[dict[str, Any]]:
    """Per layout, policy ``stop`` with rank 1's loss NaN at step K: ``{"layout", "error": message or None,
    "same": state unchanged by the failed step}``."""
    import torch.distributed as dist

    rank = dist.get_rank()
    out = []
    for layout in layouts:
        t = _build(layout, {"train.steps": str(K + 1), "train.nonfinite": "stop", "debug.nonfinite_step": str(K),
                            "debug.nonfinite_rank": "1"}, rank)
        error = None
        for _ in range(K - 1):
            t.train_step()
        before = _state(t)
        try:
            t.train_step()
        except NonFiniteError as exc:
            error = str(exc)
        after = _state(t)
        t.optimizer.zero_grad(set_to_none=True)
        out.append({"layout": layout, "error": error,
                    "same": all(torch.equal(a, b) for a, b in zip(before, after))})
    return out
