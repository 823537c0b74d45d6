"""Rank-side checks of ``train.precision = bf16`` (run inside LocalWorld ranks by tests/dist/test_precision.py; the
one-process reference runs in the test process itself through ``run_layout`` on a world of one).

Each layout builds the real ``Trainer`` (meshes from the per-rank cache), trains ``K`` steps and reports the losses,
the full final parameters (``sw.full_state_dict``), the dtypes of every gradient the rank held (the strategy's
``grads()``, read by the non-finite guard just before the optimizer step), of its parameters and optimizer state,
and the dtypes the model's modules returned (proof that autocast ran: a Linear under bf16 autocast returns bf16).
"""

from __future__ import annotations

import copy
import tempfile
from pathlib import Path
from typing import Any

import torch

import shardwise as sw
from shardwise.runtime import trainer as trainer_mod
from shardwise.runtime.config import load_config, validate
from shardwise.world import World

K = 3

# SGD (momentum 0.9), not AdamW: Adam normalises each gradient by its own scale, so near-zero gradients whose
# sign bf16 rounding flips move by a full step and the final weights would compare badly for any two runs; with
# SGD a weight's move is proportional to its gradient, so the parameter comparison measures gradient error.
SMALL = {"data.global_batch": "8", "parallel.micro_batch": "2", "optimizer.warmup_steps": "0", "optimizer.name": "sgd",
         "optimizer.lr": "0.3", "model.n_layer": "2", "model.block_size": "32", "train.steps": str(K)}

LAYOUTS: dict[str, dict[str, str]] = {
    "dp2": {},
    "zero3": {"parallel.zero_stage": "3"},
    "tp2": {"parallel.tp": "2"},
    # 1F1B with activation checkpointing: the recomputation in backward must run under the forward's autocast
    "pp2-1f1b-ckpt": {"parallel.pp": "2", "parallel.pp_schedule": "1f1b", "parallel.activation_checkpointing": "true"},
    # zero-bubble: B/W split, W by the closed forms of weight_grad.py on bf16 output gradients
    "pp2-zbh1": {"parallel.pp": "2", "parallel.pp_schedule": "zb-h1"},
}

HYBRIDS: dict[str, dict[str, str]] = {  # 4 ranks
    "pp2xtp2-zbh2": {"parallel.pp": "2", "parallel.tp": "2", "parallel.pp_schedule": "zb-h2"},
    "pp2xdp2-zero1": {"parallel.pp": "2", "parallel.zero_stage": "1"},
}


def initial_params() -> dict[str, torch.Tensor]:
    """The weights every layout starts from (``build_strategy`` seeds the GPT with ``train.seed``)."""
    from shardwise.models.gpt import GPT

    cfg = validate(load_config(overrides={**SMALL, "parallel.nproc": "1"}))
    torch.manual_seed(cfg.train.seed)
    return {k: v.detach().float() for k, v in GPT(cfg.model).state_dict().items()}


def _tensor_dtypes(t: trainer_mod.Trainer) -> tuple[set[str], set[str]]:
    """Dtypes of this rank's parameters (ZeRO: its flat master shards too) and optimizer state tensors."""
    params = {str(q.dtype) for q in t.model.parameters()}
    if t.zero:
        params |= {str(g.master.dtype) for g in t.model.groups}
    state = t.optimizer.state
    opt = {str(v.dtype) for s in state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return params, opt


def run_layout(overrides: dict[str, str], precision: str, world: World, mesh_of: Any) -> dict[str, Any]:
    """Train ``K`` steps of ``SMALL`` + ``overrides`` in ``precision``; ``mesh_of(**axes)`` gives the mesh."""
    cfg = validate(load_config(overrides={**SMALL, **overrides, "train.precision": precision}))
    p = cfg.parallel
    axes = dict(pp=p.pp, dp=p.dp, tp=p.tp) if p.pp > 1 else dict(dp=p.dp, tp=p.tp)
    trainer_mod._build_mesh = lambda *_: mesh_of(**axes)  # cached meshes: no new process groups per layout
    t = trainer_mod.Trainer(cfg, Path(tempfile.mkdtemp()), world)
    grads: set[str] = set()
    outputs: set[str] = set()
    finite = t._finite

    def spy(loss: torch.Tensor) -> bool:  # the guard runs after the passes, before the optimizer step
        grads.update(str(g.tensor.dtype) for g in t.strategy.grads())
        return finite(loss)
    t._finite = spy  # type: ignore[method-assign]
    hooks = [m.register_forward_hook(lambda _m, _a, out: outputs.add(str(out.dtype))
                                     if isinstance(out, torch.Tensor) else None) for m in t.plain.modules()]
    losses = [t.train_step()[0] for _ in range(K)]
    for h in hooks:
        h.remove()
    params, opt = _tensor_dtypes(t)
    full = {k: v.float().cpu() for k, v in sw.full_state_dict(t.model).items()}
    interpreter = getattr(t.model, "interpreter", None)  # a pipeline: what crossed its stage boundaries
    boundary = ({str(spec.dtype) for specs in interpreter.shapes.values() for spec in specs}
                if interpreter is not None else set())
    return {"losses": losses, "params": full, "grad_dtypes": grads, "param_dtypes": params, "opt_dtypes": opt,
            "output_dtypes": outputs, "boundary": boundary}


def check_layouts(names: list[str], precision: str) -> list[dict[str, Any]]:
    """Per layout of ``LAYOUTS``/``HYBRIDS`` (on this world's ranks): ``run_layout``'s report."""
    import torch.distributed as dist

    from tests.dist.meshes import mesh

    n = dist.get_world_size()
    world = World(rank=dist.get_rank(), world_size=n, local_rank=dist.get_rank(), backend="gloo",
                  device=torch.device("cpu"))
    table = {**LAYOUTS, **HYBRIDS}
    return [run_layout({**table[name], "parallel.nproc": str(n)}, precision, world, mesh) for name in names]


def check_bf16_boundary() -> dict[str, Any]:
    """``sw.pipeline(autocast=bf16)`` of an ``nn.Sequential`` whose first stage ends in a Linear, so a bf16 tensor
    crosses the stage boundary (and its bf16 gradient comes back): 1F1B's loss and this rank's weight gradients
    against the same model on this rank alone under the same autocast (no communication for the reference)."""
    from torch import nn

    from tests.dist.meshes import mesh

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.Linear(32, 8))
    ref = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = nn.functional.mse_loss(ref(x), y)
    ref_loss.backward()
    pipe = sw.pipeline(model, mesh(pp=2), microbatches=1, schedule="1f1b", split=["2"],
                       loss_fn=nn.functional.mse_loss, autocast=torch.bfloat16)
    loss = pipe.step(x, y)
    dtypes = {str(spec.dtype) for specs in pipe.interpreter.shapes.values() for spec in specs}
    names = dict(ref.named_parameters())
    err = max(float((q.grad - names[n.removeprefix("parts.").replace("/", ".")].grad).abs().max())
              for s in pipe.stages.values() for n, q in s.named_parameters())  # stage keys: parts.<name with />
    grad_dtypes = {str(q.grad.dtype) for q in pipe.parameters()}
    return {"loss_err": abs(loss - float(ref_loss.detach())), "boundary": dtypes, "grad_err": err, "grad_dtypes": grad_dtypes}
