"""The public API contract (ARCHITECTURE.md, "Public API") called exactly as written, on a 2×2 mesh of 4 ranks."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16))


def contract_calls() -> dict:
    sw.init()                                           # already initialised by the harness: returns the world
    mesh = sw.Mesh(dp=2, tp=2)
    out = {"size": mesh.size("tp"), "coord": mesh.coord("tp"), "group": mesh.group("tp") is not None,
           "axes": mesh.axes, "shape": mesh.shape}
    t = torch.ones(6)
    out["ring"] = sw.comm.all_reduce(t, mesh, "dp", op="sum", algorithm="ring").tolist()
    out["gather"] = sw.comm.all_gather(torch.ones(2), mesh, "dp").shape[0]
    out["scatter"] = sw.comm.reduce_scatter(torch.ones(4), mesh, "dp", op="sum").tolist()
    out["placements"] = [str(sw.Split(0)), str(sw.Replicate()), str(sw.Partial("sum"))]
    full = torch.arange(24.0).reshape(4, 6)
    x = sw.distribute(full, mesh, [sw.Split(0), sw.Replicate()])
    y = x.to_sbp([sw.Replicate(), sw.Replicate()])
    out["boxing"] = bool(torch.equal(y.to_local(), full) and torch.equal(x.full(), full))
    out["local_rows"] = x.to_local().shape[0]

    model = sw.DataParallel(_gpt(), mesh, axis="dp", bucket_cap_mb=25, overlap=True)
    idx, tgt = synthetic_batch(2, 16, 64, torch.Generator().manual_seed(mesh.coord("dp")))
    with model.no_sync():
        lm_loss(model(idx), tgt).backward()
    lm_loss(model(idx), tgt).backward()
    out["dp_grads"] = all(p.grad is not None for p in model.parameters())

    tp_model = sw.parallelize(_gpt(), mesh, {"blocks.*.mlp.fc": sw.ColumnParallel(),
                                              "blocks.*.mlp.proj": sw.RowParallel()})
    ref = _gpt().state_dict()
    got = sw.full_state_dict(tp_model)
    out["tp_full_state"] = set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)

    zmodel, opt = sw.zero(_gpt(), mesh, stage=3, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3))
    lm_loss(zmodel(idx), tgt).backward()
    opt.step()
    report = sw.memory_report(zmodel, opt)
    out["memory_keys"] = sorted(report)
    out["zero_full_state_keys"] = set(sw.full_state_dict(zmodel)) == set(ref)
    return out


def pipeline_call() -> float:
    mesh = sw.Mesh(pp=2)
    pipe = sw.pipeline(_gpt(), mesh, axis="pp", microbatches=4, schedule="1f1b",
                       loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    idx, tgt = synthetic_batch(8, 16, 64, torch.Generator().manual_seed(0))
    loss = pipe.step(idx, tgt)
    return float(loss)
