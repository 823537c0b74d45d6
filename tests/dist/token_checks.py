"""Rank-side checks of loss-masked training and the validation pass (run inside LocalWorld ranks by
tests/dist/test_token_loss.py; the one-device reference is computed in the test process by plain torch).

Each layout builds the real ``Trainer`` on the SMALL GPT, feeds it hand-made batches whose targets are partly
``IGNORE`` (a row with no counted target, rows with a few, rows with all), trains ``STEPS`` steps through the
token-weighted loss, then runs ``Strategy.eval_sums`` on validation batches with their own mask. Reported: the
step losses, the full final parameters, the validation sums, and whether the evaluation touched any gradient.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

import shardwise as sw
from shardwise.runtime import trainer as trainer_mod
from shardwise.runtime.config import load_config, validate
from shardwise.data.windows import IGNORE
from shardwise.runtime.token_loss import TokenNormalized
from shardwise.world import World

STEPS = 2
G, T, V = 8, 32, 256
SMALL = {"data.global_batch": str(G), "parallel.micro_batch": "2", "optimizer.warmup_steps": "0",
         "optimizer.name": "sgd", "optimizer.lr": "0.5", "optimizer.weight_decay": "0", "optimizer.schedule": "constant",
         "model.n_layer": "2", "model.block_size": str(T), "train.steps": str(STEPS)}

LAYOUTS: dict[str, dict[str, str]] = {
    "dp2": {},
    "tp2": {"parallel.tp": "2"},
    "zero1": {"parallel.zero_stage": "1"},
    "zero3-ckpt": {"parallel.zero_stage": "3", "parallel.activation_checkpointing": "true"},
    "pp2-1f1b": {"parallel.pp": "2", "parallel.pp_schedule": "1f1b"},
    "pp2-interleaved": {"parallel.pp": "2", "parallel.pp_schedule": "interleaved", "parallel.pp_chunks": "2",
                        "model.n_layer": "4"},
}
HYBRIDS: dict[str, dict[str, str]] = {  # 4 ranks
    "dp2xtp2-zero3": {"parallel.tp": "2", "parallel.zero_stage": "3"},
    "pp2xdp2-zero1": {"parallel.pp": "2", "parallel.zero_stage": "1"},
    "pp2xtp2": {"parallel.pp": "2", "parallel.tp": "2"},
}


def masked_batch(seed: int, rows: int = G) -> tuple[torch.Tensor, torch.Tensor]:
    """``(idx, targets)`` (rows, T): random ids; row 0 counts no target, row 1 one, the last all, the others a
    random share — so micro-batches and ranks count very different numbers of tokens."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (rows, T), generator=g)
    y = torch.randint(0, V, (rows, T), generator=g)
    keep = torch.rand(rows, T, generator=g) < torch.linspace(0.05, 0.9, rows)[:, None]
    keep[0], keep[1], keep[1, 5], keep[-1] = False, False, True, True
    return x, y.masked_fill(~keep, IGNORE)


def _rank_batches(x: torch.Tensor, y: torch.Tensor, dp_size: int, dp_rank: int, micro: int) -> list:
    """This rank's rows of a global batch (strided over dp, as ``ShardedSampler`` deals them), in passes."""
    xs, ys = x[dp_rank::dp_size], y[dp_rank::dp_size]
    return list(zip(xs.split(micro), ys.split(micro)))


def run_layout(overrides: dict[str, str], world: World, mesh_of: Any) -> dict[str, Any]:
    cfg = validate(load_config(overrides={**SMALL, **overrides}))
    p = cfg.parallel
    axes = dict(pp=p.pp, dp=p.dp, tp=p.tp) if p.pp > 1 else dict(dp=p.dp, tp=p.tp)
    trainer_mod._build_mesh = lambda *_: mesh_of(**axes)
    t = trainer_mod.Trainer(cfg, Path(tempfile.mkdtemp()), world)
    dp_size, dp_rank = t.strategy.data_shard()
    micro = p.micro_batch * p.dp // dp_size
    steps = iter([_rank_batches(*masked_batch(100 + s), dp_size, dp_rank, micro) for s in range(STEPS)])
    t.data.next = lambda: next(steps)  # type: ignore[method-assign]
    t.token_loss = TokenNormalized(t.strategy.sum_loss, G)
    losses = [t.train_step()[0] for _ in range(STEPS)]
    val = _rank_batches(*masked_batch(7, 2 * G), dp_size, dp_rank, micro)
    t.plain.train(False)
    before = [None if q.grad is None else q.grad.clone() for q in t.plain.parameters()]
    total, count = t.strategy.eval_sums(val)
    after = [q.grad for q in t.plain.parameters()]
    touched = any((a is None) != (b is None) or (a is not None and not torch.equal(a, b)) for a, b in zip(before, after))
    full = {k: v.float().cpu() for k, v in sw.full_state_dict(t.model).items()}
    return {"losses": losses, "params": full, "val": (total, count), "grads_touched": touched}


def check_layouts(names: list[str]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from tests.dist.meshes import mesh

    n = dist.get_world_size()
    world = World(rank=dist.get_rank(), world_size=n, local_rank=dist.get_rank(), backend="gloo",
                  device=torch.device("cpu"))
    table = {**LAYOUTS, **HYBRIDS}
    return [run_layout({**table[name], "parallel.nproc": str(n)}, world, mesh) for name in names]
