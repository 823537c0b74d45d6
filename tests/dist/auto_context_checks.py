"""Rank-side checks of ``sw.auto`` with context parallelism (run inside LocalWorld ranks by
tests/dist/test_auto_context.py): every rank plans on the *full* sequence, applies the plan with
``sw.parallelize`` (tensor-parallel styles, then ``context_parallel``), runs its ``shard_sequence`` chunks, and
compares its local logits and every parameter gradient (gathered over tp, summed over cp) with one device."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.parallel.tensor.apply_plan import full_tensor
from tests.dist.context_checks import _model_case, rel
from tests.dist.meshes import mesh as cached_mesh

HF_MEGATRON = {"model.layers.*.self_attn.q_proj": "column", "model.layers.*.self_attn.k_proj": "column",
               "model.layers.*.self_attn.v_proj": "column", "model.layers.*.self_attn.o_proj": "row",
               "model.layers.*.mlp.gate_proj": "column", "model.layers.*.mlp.up_proj": "column",
               "model.layers.*.mlp.down_proj": "row"}
"""Pins that make the tiny Llama's plan Megatron's on the tp axis (at this size sw.auto keeps tp a data axis)."""


def check_auto_cp(axes: dict, kind: str, pinned: bool = False, b: int = 2, S: int = 16) -> dict:
    mesh = cached_mesh(**axes)
    model, fwd, vocab, _ = _model_case(kind, False)
    g = torch.Generator().manual_seed(7)
    ids, targets = torch.randint(0, vocab, (b, S), generator=g), torch.randint(0, vocab, (b, S), generator=g)
    logits = fwd(model, ids)
    F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), reduction="sum").div(b * S).backward()
    cp_model = copy.deepcopy(model)
    cp_model.zero_grad(set_to_none=True)
    with CommCounter() as c:
        plan = sw.auto(cp_model, mesh, example_inputs=(ids,), pins=HF_MEGATRON if pinned else None)
    planning_comms = len(c.records)
    sw.parallelize(cp_model, mesh, plan)
    local_ids, local_t = sw.shard_sequence(ids, mesh, "cp"), sw.shard_sequence(targets, mesh, "cp")
    local_logits = fwd(cp_model, local_ids)
    F.cross_entropy(local_logits.reshape(-1, vocab), local_t.reshape(-1), reduction="sum").div(b * S).backward()
    worst, missing = 0.0, []
    ref = dict(model.named_parameters())
    for name, p in cp_model.named_parameters():
        if p.grad is None:
            missing.append(name)
            continue
        total = sw.comm.all_reduce(full_tensor(p, p.grad).clone(), mesh, "cp")
        worst = max(worst, rel(total, ref[name].grad))
    return {"logits": rel(local_logits, sw.shard_sequence(logits, mesh, "cp")), "grads": worst, "missing": missing,
            "plan": str(plan), "styles": {k: repr(v) for k, v in plan.styles.items()}, "tp": plan.tp_axis,
            "dp": plan.dp_axes, "cp": plan.cp_axis, "context": plan.context, "planning_comms": planning_comms}
