"""Rank-side checks of ``parallel.ep`` through the runtime (run by tests/dist/test_moe_runtime.py; the one-device
reference runs in the test process through ``run_reference`` on a world of one).

Each layout builds the real ``Trainer`` (meshes, the expert mesh included, from the per-rank cache), trains ``K``
AdamW steps of a small MoE GPT and reports the losses it logged, the routing statistics of each step (the
metrics record's ``moe`` entry), the collectives of each step by op, and the gathered final parameters
(``sw.full_state_dict``: the experts all-gathered over ep). ``save_then_resume`` also writes a checkpoint after
``K`` steps, and ``resume_one_step`` loads one (saved by another layout) and trains step ``K + 1``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.runtime import experts as experts_mod
from shardwise.runtime import trainer as trainer_mod
from shardwise.runtime.config import load_config, validate
from shardwise.world import World
from tests.dist.clip_checks import _text_file, _world

K = 2

# optimizer.eps 1e-5: AdamW's first steps are ~lr·sign(g), so a gradient that is zero in exact arithmetic (the key
# bias of attention) is pure summation noise that eps 1e-8 would turn into a ±lr step; 1e-5 damps only those
SMALL = {"data.global_batch": "8", "parallel.micro_batch": "2", "optimizer.warmup_steps": "0",
         "optimizer.lr": "0.01", "optimizer.eps": "1e-5", "optimizer.schedule": "constant", "model.n_layer": "2",
         "model.block_size": "32",
         "model.n_experts": "4", "model.top_k": "2", "model.moe_ffn": "32", "model.n_shared_experts": "1",
         "model.moe_aux_loss_coef": "0.05", "train.steps": str(K + 1)}

MODELS: dict[str, dict[str, str]] = {  # the routing variants, each with its own one-device reference
    "aux": {},
    "capacity": {"model.capacity_factor": "1.0"},
    "bias": {"model.moe_bias_rate": "0.01", "model.moe_aux_loss_coef": "0.0", "model.router": "sigmoid"},
    "clip": {"optimizer.clip_grad_norm": "0.05"},
    "dense": {"model.n_experts": "0"},  # well below the gradient norm (~1-3): clipping bites
}

LAYOUTS: dict[str, tuple[str, dict[str, str]]] = {  # name -> (model variant, parallel overrides)
    # 2 ranks
    "ep2": ("aux", {"parallel.ep": "2"}),
    "ep2-capacity": ("capacity", {"parallel.ep": "2"}),
    "ep2-bias": ("bias", {"parallel.ep": "2"}),
    "ep2-clip": ("clip", {"parallel.ep": "2"}),
    "ep2-zero1": ("aux", {"parallel.ep": "2", "parallel.zero_stage": "1"}),
    "ep2-zero2": ("capacity", {"parallel.ep": "2", "parallel.zero_stage": "2"}),
    "ep2-zero3-clip": ("clip", {"parallel.ep": "2", "parallel.zero_stage": "3"}),
    "ep1-dp2": ("aux", {"parallel.ep": "1"}),
    "ep2-ckpt": ("capacity", {"parallel.ep": "2", "parallel.activation_checkpointing": "true"}),
    # 4 ranks
    "ep4": ("aux", {"parallel.ep": "4"}),
    "ep2xdp2-zero1": ("aux", {"parallel.ep": "2", "parallel.zero_stage": "1"}),
    "ep2xdp2-zero3-clip": ("clip", {"parallel.ep": "2", "parallel.zero_stage": "3"}),
    "ep2xtp2-clip": ("clip", {"parallel.ep": "2", "parallel.tp": "2"}),
    "ep2xtp2-bias": ("bias", {"parallel.ep": "2", "parallel.tp": "2"}),
    "ep2xtp2-zero3": ("aux", {"parallel.ep": "2", "parallel.tp": "2", "parallel.zero_stage": "3"}),
}


def config(overrides: dict[str, str]) -> Any:
    return validate(load_config(overrides={**SMALL, **overrides, "data.path": _text_file()}))


def _trainer(cfg: Any, world: World, mesh_of: Callable[..., sw.Mesh], run_dir: Path | None = None
             ) -> trainer_mod.Trainer:
    import tempfile

    p = cfg.parallel
    trainer_mod._build_mesh = lambda *_: mesh_of(dp=p.dp * p.cp, tp=p.tp)  # cached meshes: no new groups
    experts_mod.expert_mesh = lambda c, _m: mesh_of(**experts_mod.expert_mesh_axes(c.parallel))
    return trainer_mod.Trainer(cfg, run_dir or Path(tempfile.mkdtemp()), world)


def _full(t: trainer_mod.Trainer) -> dict[str, torch.Tensor]:
    return {k: v.float().cpu().clone() for k, v in sw.full_state_dict(t.model).items()}  # not views: steps follow


def _steps(t: trainer_mod.Trainer, n: int) -> dict[str, Any]:
    losses, stats, ops, norms = [], [], [], []
    for _ in range(n):
        with CommCounter() as c:
            losses.append(t.train_step()[0])
        stats.append(t.moe.stats)
        norms.append(t.grad_norm)
        counted: dict[str, int] = {}
        for r in c.records:
            counted[r.op] = counted.get(r.op, 0) + 1
        ops.append(counted)
    return {"losses": losses, "stats": stats, "ops": ops, "norms": norms}


def run_reference(model: str, world: World, mesh_of: Callable[..., sw.Mesh]) -> dict[str, Any]:
    """One device, ``K + 1`` steps of the variant: losses, statistics, the parameters after ``K`` and ``K + 1``."""
    t = _trainer(config({**MODELS[model], "parallel.nproc": "1"}), world, mesh_of)
    first = _steps(t, K)
    at_k = _full(t)
    last = _steps(t, 1)
    return {"losses": first["losses"] + last["losses"], "stats": first["stats"] + last["stats"], "params": at_k,
            "params_next": _full(t), "norms": first["norms"] + last["norms"]}


def run_layout(name: str, world: World, mesh_of: Callable[..., sw.Mesh], save_to: str = "") -> dict[str, Any]:
    model, parallel = LAYOUTS[name]
    t = _trainer(config({**MODELS[model], **parallel, "parallel.nproc": str(world.world_size)}), world, mesh_of,
                 Path(save_to) if save_to else None)
    out = _steps(t, K)
    out["params"] = _full(t)
    pieces = t.strategy.experts.params() if t.strategy.experts else []
    out["experts_per_rank"] = [tuple(q.shape) for q in pieces]
    opt = getattr(t.strategy, "expert_optimizer", None)  # ZeRO: the experts' own optimizer
    out["expert_numel"] = sum(q.numel() for q in pieces)
    out["expert_state_numel"] = (sum(v.numel() for st in opt.state.values() for k, v in st.items() if k == "exp_avg")
                                 if opt is not None else None)
    if save_to:
        out["checkpoint"] = str(t.save())
    return out


def resume_one_step(name: str, checkpoint: str, world: World, mesh_of: Callable[..., sw.Mesh]) -> dict[str, Any]:
    model, parallel = LAYOUTS[name]
    t = _trainer(config({**MODELS[model], **parallel, "parallel.nproc": str(world.world_size)}), world, mesh_of)
    t.resume(checkpoint)
    out = _steps(t, 1)
    out["params"] = _full(t)
    return out


def check_layouts(names: list[str], save: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Per layout (on this world's ranks): ``run_layout``'s report; ``save``: layout -> directory to checkpoint
    its step ``K`` into."""
    from tests.dist.meshes import mesh

    world = _world()
    return [run_layout(name, world, mesh, (save or {}).get(name, "")) for name in names]


def check_resumes(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per ``(layout, checkpoint)``: ``resume_one_step``'s report."""
    from tests.dist.meshes import mesh

    world = _world()
    return [resume_one_step(name, ckpt, world, mesh) for name, ckpt in pairs]


def nonfinite_expert_grad(name: str, world: World, mesh_of: Callable[..., sw.Mesh]) -> dict[str, Any]:
    """One step of the layout with ``train.nonfinite = skip`` whose passes leave a NaN in one expert piece's
    gradient on the last rank only: whether this rank skipped the step and kept its weights."""
    model, parallel = LAYOUTS[name]
    t = _trainer(config({**MODELS[model], **parallel, "parallel.nproc": str(world.world_size),
                         "train.nonfinite": "skip"}), world, mesh_of)
    before = _full(t)
    passes = t.strategy.passes

    def poisoned(*args: Any, **kwargs: Any) -> Any:
        loss = passes(*args, **kwargs)
        if world.rank == world.world_size - 1:
            t.strategy.experts.params()[-1].grad.view(-1)[0] = float("nan")
        return loss
    t.strategy.passes = poisoned  # type: ignore[method-assign]
    t.train_step()
    after = _full(t)
    return {"skipped": t.last_skipped, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def check_nonfinite(names: list[str]) -> list[dict[str, Any]]:
    from tests.dist.meshes import mesh

    world = _world()
    return [nonfinite_expert_grad(name, world, mesh) for name in names]
