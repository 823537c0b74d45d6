"""Rank-side checks of ``parallel.ep`` composed with ``parallel.pp`` and ``parallel.cp`` through the runtime (run by
tests/dist/test_moe_pipeline.py; the one-device reference runs in the test process through ``run_reference``).

Each layout builds the real ``Trainer`` (its meshes — runtime, expert, context-parallel — from the per-rank cache),
trains ``K`` AdamW steps of a small MoE GPT and reports the logged losses, the routing statistics of each step
(the metrics record's ``moe`` entry: this rank's blocks, loads summed over dp × cp), the all-to-alls of each step
and the gathered final parameters (``sw.full_state_dict``: experts all-gathered over ep, stages over pp).
``resume_one_step`` loads a checkpoint saved by another layout and trains step ``K + 1``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.runtime import context_split as cp_mod
from shardwise.runtime import experts as experts_mod
from shardwise.runtime import trainer as trainer_mod
from shardwise.runtime.config import load_config, validate
from shardwise.runtime.strategy import mesh_axes
from shardwise.world import World
from tests.dist.clip_checks import _text_file, _world

K = 2

SMALL = {"data.global_batch": "8", "parallel.micro_batch": "2", "optimizer.warmup_steps": "0",
         "optimizer.lr": "0.01", "optimizer.schedule": "constant", "optimizer.eps": "1e-4", "model.n_layer": "2", "model.block_size": "32",
         "model.n_experts": "4", "model.top_k": "2", "model.moe_ffn": "32", "model.n_shared_experts": "1",
         "model.moe_aux_loss_coef": "0.05", "train.steps": str(K + 1)}

MODELS: dict[str, dict[str, str]] = {  # routing variants, each with its own one-device reference
    "aux": {},
    "capacity": {"model.capacity_factor": "1.0"},
    "bias": {"model.moe_bias_rate": "0.01", "model.moe_aux_loss_coef": "0.0", "model.router": "sigmoid"},
    "clip": {"optimizer.clip_grad_norm": "0.05"},  # well below the gradient norm (~1-3): clipping bites
    "mixtral": {"model.hf_config": "mixtral"},
}

PP = {"parallel.pp": "2", "parallel.ep": "2"}  # 4 ranks: (pp, dp) = (2, 2), ep over each stage's dp ranks
LAYOUTS: dict[str, tuple[str, dict[str, str]]] = {  # name -> (model variant, parallel overrides), all on 4 ranks
    "pp2-ep2-1f1b": ("aux", {**PP, "parallel.pp_schedule": "1f1b"}),
    "pp2-ep2-zb-zero1-clip": ("clip", {**PP, "parallel.pp_schedule": "zb-h1", "parallel.zero_stage": "1"}),
    "pp2-ep2-zb-capacity": ("capacity", {**PP, "parallel.pp_schedule": "zb-h1"}),
    "pp2-ep2-interleaved-bias": ("bias", {**PP, "parallel.pp_schedule": "interleaved", "parallel.pp_chunks": "2"}),
    "pp2-ep2-gpipe-clip": ("clip", {**PP, "parallel.pp_schedule": "gpipe"}),
    # cp: the ep axis folds into dp × cp; (dp, cp) = (2, 2) with ep 2 leaves edp = 2 (the expert gradients' sum)
    "cp2-ep2": ("aux", {"parallel.cp": "2", "parallel.ep": "2"}),
    "cp2-ep4-capacity": ("capacity", {"parallel.cp": "2", "parallel.ep": "4"}),
    "cp2-ep2-zero1-clip": ("clip", {"parallel.cp": "2", "parallel.ep": "2", "parallel.zero_stage": "1"}),
    # dp 1: ep over the cp ranks, inside each pipeline stage
    "pp2-cp2-ep2-capacity": ("capacity", {**PP, "parallel.cp": "2"}),
    # the Hugging Face decoder's MoE layers
    "hf-pp2-ep2-zb": ("mixtral", {**PP, "parallel.pp_schedule": "zb-h1"}),
    "hf-cp2-ep2": ("mixtral", {"parallel.cp": "2", "parallel.ep": "2"}),
}


MIXTRAL = dict(model_type="mixtral", vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2, num_local_experts=4,
               router_aux_loss_coef=0.05, max_position_embeddings=64)
"""A Hugging Face mixture of experts (``model.hf_config``): the Llama-family decoder with shardwise's MoE blocks."""


def _hf_config() -> str:
    if not _HF:
        path = Path(tempfile.mkdtemp()) / "config.json"
        path.write_text(json.dumps(MIXTRAL))
        _HF.append(str(path))
    return _HF[0]


_HF: list[str] = []


def config(overrides: dict[str, str]) -> Any:
    base = dict(SMALL)
    if overrides.get("model.hf_config") == "mixtral":  # the HF config sets the shape: no model.* flags
        base = {k: v for k, v in SMALL.items() if not k.startswith("model.")}
        overrides = {**overrides, "model.hf_config": _hf_config()}
    return validate(load_config(overrides={**base, **overrides, "data.path": _text_file()}))


def _trainer(cfg: Any, world: World, mesh_of: Callable[..., sw.Mesh], run_dir: Path | None = None
             ) -> trainer_mod.Trainer:
    trainer_mod._build_mesh = lambda p, *_: mesh_of(**mesh_axes(p))  # cached meshes: no new groups per layout
    experts_mod.expert_mesh = lambda c, _m: mesh_of(**experts_mod.expert_mesh_axes(c.parallel))
    cp_mod.Mesh = lambda timeout_s=None, **axes: mesh_of(**axes)  # type: ignore[assignment,misc]
    return trainer_mod.Trainer(cfg, run_dir or Path(tempfile.mkdtemp()), world)


def _full(t: trainer_mod.Trainer) -> dict[str, torch.Tensor]:
    # a copy: on one process full_state_dict returns the live tensors, which later steps change in place
    return {k: v.detach().float().cpu().clone() for k, v in sw.full_state_dict(t.model).items()}


def _steps(t: trainer_mod.Trainer, n: int) -> dict[str, Any]:
    losses, stats, a2a, norms = [], [], [], []
    for _ in range(n):
        with CommCounter() as c:
            losses.append(t.train_step()[0])
        stats.append(t.moe.stats)
        a2a.append(c.count("all_to_all"))
        norms.append(t.grad_norm)  # the step's gradient norm before clipping (NaN without clipping)
    return {"losses": losses, "stats": stats, "a2a": a2a, "norms": norms}


def run_reference(model: str, world: World, mesh_of: Callable[..., sw.Mesh]) -> dict[str, Any]:
    """One device, ``K + 1`` steps of the variant: losses, statistics, the parameters after ``K`` and ``K + 1``."""
    t = _trainer(config({**MODELS[model], "parallel.nproc": "1"}), world, mesh_of)
    init = _full(t)
    first = _steps(t, K)
    at_k = _full(t)
    last = _steps(t, 1)
    return {"losses": first["losses"] + last["losses"], "stats": first["stats"] + last["stats"], "params": at_k,
            "params_next": _full(t), "norms": first["norms"] + last["norms"], "init": init}


def run_layout(name: str, world: World, mesh_of: Callable[..., sw.Mesh], save_to: str = "") -> dict[str, Any]:
    model, parallel = LAYOUTS[name]
    t = _trainer(config({**MODELS[model], **parallel, "parallel.nproc": str(world.world_size)}), world, mesh_of,
                 Path(save_to) if save_to else None)
    out = _steps(t, K)
    out["params"] = _full(t)
    out["experts_per_rank"] = [tuple(q.shape) for q in t.strategy.experts.params()]
    out["passes"] = t.strategy.moe_passes(t.cfg.parallel.grad_accum) if hasattr(t.strategy, "moe_passes") else \
        t.cfg.parallel.grad_accum
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
    """Per layout (on this world's ranks): ``run_layout``'s report; ``save``: layout -> directory for step K."""
    from tests.dist.meshes import mesh

    world = _world()
    return [run_layout(name, world, mesh, (save or {}).get(name, "")) for name in names]


def check_resumes(pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per ``(layout, checkpoint)``: ``resume_one_step``'s report."""
    from tests.dist.meshes import mesh

    world = _world()
    return [resume_one_step(name, ckpt, world, mesh) for name, ckpt in pairs]


def check_references(models: list[str]) -> dict[str, dict[str, Any]]:
    """On a world of one rank: ``run_reference`` of each model variant."""
    from tests.dist.meshes import mesh

    world = _world()
    return {m: run_reference(m, world, mesh) for m in models}
