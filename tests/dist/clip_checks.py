"""Rank-side checks of ``optimizer.clip_grad_norm`` (run inside LocalWorld ranks by tests/dist/test_clip_grad_norm.py;
the one-device reference runs in the test process itself through ``run_reference`` on a world of one).

Each layout builds the real ``Trainer`` (meshes from the per-rank cache) with clipping on, trains ``K`` SGD steps
and reports the norm each step logged (``Trainer.grad_norm``), the collectives each ``Strategy.clip_grad_norm`` call
ran, and the full final parameters (``sw.full_state_dict``). The reference trains the same config on one device
with clipping *off* in the trainer and ``torch.nn.utils.clip_grad_norm_`` over the whole model's parameters called
between the non-finite check and the optimizer step (where the trainer clips): torch's function, not ours.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.runtime import trainer as trainer_mod
from shardwise.runtime.config import load_config, validate
from shardwise.world import World

K = 2
MAX_NORM = 0.05
"""Well below the GPT's gradient norm at these weights (~3.3-3.8): clipping scales each step by ~1/70."""

# SGD (momentum 0.9): a weight's update is proportional to its clipped gradient, so the weights measure the
# clipping; Adam would hide it (its first step is m/√v ≈ sign(g) whatever the gradient's scale).
SMALL = {"data.global_batch": "8", "parallel.micro_batch": "2", "optimizer.warmup_steps": "0", "optimizer.name": "sgd",
         "optimizer.lr": "0.5", "optimizer.schedule": "constant", "model.n_layer": "2", "model.block_size": "32",
         "train.steps": str(K)}

LAYOUTS: dict[str, dict[str, str]] = {  # 2 ranks
    "dp2": {},
    "tp2-ckpt": {"parallel.tp": "2", "parallel.activation_checkpointing": "true"},
    "zero1": {"parallel.zero_stage": "1"},
    "zero2": {"parallel.zero_stage": "2"},
    "zero3": {"parallel.zero_stage": "3"},
    "pp2": {"parallel.pp": "2"},  # wte and lm_head tied across the two pipeline ranks
}

HYBRIDS: dict[str, dict[str, str]] = {  # 4 ranks
    "dp2xtp2": {"parallel.tp": "2"},
    "zero3xtp2": {"parallel.zero_stage": "3", "parallel.tp": "2"},
    "pp2xdp2": {"parallel.pp": "2"},
    "pp2xdp2-zero1": {"parallel.pp": "2", "parallel.zero_stage": "1"},
    "pp2xtp2-ckpt": {"parallel.pp": "2", "parallel.tp": "2", "parallel.activation_checkpointing": "true"},
}

BF16: dict[str, dict[str, str]] = {  # 2 ranks, train.precision = bf16 (compared with a bf16 reference)
    "zero2-bf16": {"parallel.zero_stage": "2", "train.precision": "bf16"},
}


_TEXT: list[str] = []


def _text_file() -> str:
    """A 32 kB text file of the generated corpus' first bytes, written once per process (the same bytes in every
    rank and in the reference): every Trainer would otherwise generate the whole 1 MB corpus, ~1 s of CPU each."""
    if not _TEXT:
        from shardwise.data.corpus import generated_text

        path = Path(tempfile.mkdtemp()) / "text.txt"
        path.write_text(generated_text(32_000))
        _TEXT.append(str(path))
    return _TEXT[0]


def config(overrides: dict[str, str], clip: float) -> Any:
    """``SMALL`` + ``overrides`` with ``optimizer.clip_grad_norm = clip``, validated."""
    return validate(load_config(overrides={**SMALL, **overrides, "optimizer.clip_grad_norm": str(clip),
                                           "data.path": _text_file()}))


def initial_params() -> dict[str, torch.Tensor]:
    """The weights every layout starts from (``build_strategy`` seeds the GPT with ``train.seed``)."""
    from shardwise.models.gpt import GPT

    cfg = config({"parallel.nproc": "1"}, 0.0)
    torch.manual_seed(cfg.train.seed)
    return {k: v.detach().float() for k, v in GPT(cfg.model).state_dict().items()}


def _trainer(cfg: Any, world: World, mesh_of: Callable[..., sw.Mesh]) -> trainer_mod.Trainer:
    p = cfg.parallel
    axes = dict(pp=p.pp, dp=p.dp, tp=p.tp) if p.pp > 1 else dict(dp=p.dp, tp=p.tp)
    trainer_mod._build_mesh = lambda *_: mesh_of(**axes)  # cached meshes: no new process groups per layout
    return trainer_mod.Trainer(cfg, Path(tempfile.mkdtemp()), world)


def _full(t: trainer_mod.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.float().cpu() for k, v in sw.full_state_dict(t.model).items()}


def run_reference(precision: str, max_norm: float | None, world: World, mesh_of: Callable[..., sw.Mesh]
                  ) -> dict[str, Any]:
    """One device, ``K`` steps: ``torch.nn.utils.clip_grad_norm_(all parameters, max_norm)`` before each optimizer
    step (``None``: no clipping). The norms it returned, the losses and the final parameters."""
    t = _trainer(config({"parallel.nproc": "1", "train.precision": precision}, 0.0), world, mesh_of)
    norms: list[float] = []
    finite = t._finite

    def clip_after_check(loss: torch.Tensor) -> bool:  # the trainer steps the optimizer right after this
        ok = finite(loss)
        if ok and max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(t.plain.parameters(), max_norm)))
        return ok
    t._finite = clip_after_check  # type: ignore[method-assign]
    losses = [t.train_step()[0] for _ in range(K)]
    return {"norms": norms, "losses": losses, "params": _full(t)}


def run_layout(overrides: dict[str, str], world: World, mesh_of: Callable[..., sw.Mesh]) -> dict[str, Any]:
    """``K`` steps of ``SMALL`` + ``overrides`` clipped at ``MAX_NORM`` by the trainer: the logged norms, the
    collectives of each ``clip_grad_norm`` call (``{op@axis: count}``), the losses and the final parameters."""
    t = _trainer(config(overrides, MAX_NORM), world, mesh_of)
    clip, calls = t.strategy.clip_grad_norm, []

    def counted_clip(max_norm: float) -> float:
        with CommCounter() as c:
            norm = clip(max_norm)
        calls.append(sorted(f"{r.op}@{r.axis}" for r in c.records))
        return norm
    t.strategy.clip_grad_norm = counted_clip  # type: ignore[method-assign]
    norms, losses = [], []
    for _ in range(K):
        losses.append(t.train_step()[0])
        norms.append(t.grad_norm)
        record = t._record(losses[-1], {k: 0.0 for k in ("fwd", "bwd", "opt", "comm", "data")} | {"step": 1.0})
        assert record["grad_norm"] == norms[-1], record  # the metrics record carries the pre-clip norm
    return {"norms": norms, "losses": losses, "params": _full(t), "calls": calls}


def run_step_collectives(overrides: dict[str, str], clip: float, world: World,
                         mesh_of: Callable[..., sw.Mesh]) -> dict[str, Any]:
    """One ``train_step`` of the layout with ``optimizer.clip_grad_norm = clip``: every collective it ran
    (``{op@axis: count}``) and how often ``Strategy.clip_grad_norm`` was called."""
    t = _trainer(config({**overrides, "train.steps": "1"}, clip), world, mesh_of)
    clip_fn, called = t.strategy.clip_grad_norm, []
    t.strategy.clip_grad_norm = lambda m: called.append(m) or clip_fn(m)  # type: ignore[method-assign]
    with CommCounter() as c:
        t.train_step()
    ops: dict[str, int] = {}
    for r in c.records:
        ops[f"{r.op}@{r.axis}"] = ops.get(f"{r.op}@{r.axis}", 0) + 1
    return {"ops": ops, "calls": len(called)}


def _world() -> World:
    import torch.distributed as dist

    return World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(), backend="gloo",
                 device=torch.device("cpu"))


def check_layouts(names: list[str]) -> list[dict[str, Any]]:
    """Per layout of ``LAYOUTS``/``HYBRIDS``/``BF16`` (on this world's ranks): ``run_layout``'s report."""
    from tests.dist.meshes import mesh

    world, table = _world(), {**LAYOUTS, **HYBRIDS, **BF16}
    return [run_layout({**table[name], "parallel.nproc": str(world.world_size)}, world, mesh) for name in names]


def check_step_collectives(names: list[str]) -> list[dict[str, Any]]:
    """Per layout: ``run_step_collectives`` with clipping off, then on."""
    from tests.dist.meshes import mesh

    world, table = _world(), {**LAYOUTS, **HYBRIDS}
    return [{clip: run_step_collectives({**table[name], "parallel.nproc": str(world.world_size)}, clip, world, mesh)
             for clip in (0.0, MAX_NORM)} for name in names]
