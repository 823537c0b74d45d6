"""Rank-side checks for transposed (``Conv1D``) and fused projections under tensor parallelism (run inside LocalWorld
ranks by tests/dist/test_fused_parallel.py): the loss and every gradient (or the parameters after one SGD step)
equal the single-device model's built from the same seed on the same full batch."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.checkpoint.layout import local_of
from shardwise.parallel.tensor.apply_plan import full_tensor, local_piece
from tests.dist import auto_checks as ac
from tests.dist import fused_models as fm
from tests.dist.meshes import mesh

BUILD = {"gpt2": fm.hf_gpt2, "fused": fm.FusedLM}


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (n, 16), generator=gen), torch.randint(0, 64, (n, 16), generator=gen)


def _compare_grads(model: nn.Module, ref_grads: dict[str, torch.Tensor]) -> None:
    inner = getattr(model, "module", model)
    for name, p in inner.named_parameters():
        full = full_tensor(p, p.grad)  # gathered over the axes the parameter is split on
        torch.testing.assert_close(full, ref_grads[name], rtol=1e-5, atol=1e-6, msg=lambda s, n=name: f"{n}: {s}")


def _local_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    inner = getattr(model, "module", model)
    return {n: tuple(p.shape) for n, p in inner.named_parameters() if n.endswith("weight")}


def check_auto(which: str, dp: int) -> dict:
    """``sw.auto`` over tp=2 (and dp=``dp``): plan, apply, one forward/backward on this rank's batch slice; the
    loss (averaged over dp) and every gradient equal one device's."""
    build = BUILD[which]
    m = mesh(dp=dp, tp=2) if dp > 1 else mesh(tp=2)
    x, y = _batch(2 * dp)
    ref_loss, ref_grads = ac._reference(build, x, y)
    torch.manual_seed(0)
    model = build()
    plan, planning_comms = ac._plan(model, m, (x,))
    model = sw.parallelize(model, m, plan)
    if dp > 1:
        model = sw.DataParallel(model, m, axis=plan.dp_axes[0])
    c = m.coord("dp") if dp > 1 else 0
    xl, yl = x[2 * c:2 * (c + 1)], y[2 * c:2 * (c + 1)]
    with CommCounter() as fwd:
        logits = ac._logits(model, xl)
    loss = ac._loss(logits, yl, plan, m)
    loss.backward()
    total = loss.detach().clone()
    if dp > 1:
        sw.comm.all_reduce(total, m, "dp", op="avg")
    torch.testing.assert_close(total.item(), ref_loss, rtol=1e-5, atol=0)
    _compare_grads(model, ref_grads)
    return {"styles": {k: repr(v) for k, v in plan.items()}, "planning_comms": planning_comms,
            "fwd_tp": fwd.count("all_reduce", axis="tp"), "shapes": _local_shapes(model), "dp": plan.dp_axes}


def _check_pieces(model: nn.Module, full: dict[str, torch.Tensor], m: sw.Mesh) -> None:
    """Every sharded parameter is this rank's piece of its full tensor under both inverse maps: tensor
    parallelism's ``local_piece`` and the checkpoint's ``local_of`` (the transposed head-split layout included)."""
    for name, p in model.named_parameters():
        assert torch.equal(local_piece(p, full[name]), p.detach()), name
        assert torch.equal(local_of(full[name], p, m, p.shape), p.detach()), name


GPT2_PLAN = {"transformer.h.*.attn.c_attn": sw.QKVParallel(4, head_attr="num_heads", divide_attrs=("split_size",)),
             "transformer.h.*.attn.c_proj": sw.RowParallel(), "transformer.h.*.mlp.c_fc": sw.ColumnParallel(),
             "transformer.h.*.mlp.c_proj": sw.RowParallel()}


def check_gpt2_hand_plan(lr: float = 0.5) -> dict:
    """A hand-written plan on GPT-2 at tp=2: one SGD step; the loss and every parameter after it (full, under the
    plain model's keys and shapes) equal one device's."""
    m = mesh(tp=2)
    x, y = _batch(2)
    torch.manual_seed(0)
    ref = fm.hf_gpt2()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    ref_loss = F.cross_entropy(ref(x).logits.reshape(-1, 64), y.reshape(-1))
    ref_loss.backward()
    ref_opt.step()
    torch.manual_seed(0)
    model = sw.parallelize(fm.hf_gpt2(), m, GPT2_PLAN, axis="tp")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss = F.cross_entropy(model(x).logits.reshape(-1, 64), y.reshape(-1))
    loss.backward()
    opt.step()
    torch.testing.assert_close(loss.item(), ref_loss.item(), rtol=1e-5, atol=0)
    full = sw.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")
    _check_pieces(model, full, m)
    return {"shapes": _local_shapes(model), "split_size": model.transformer.h[0].attn.split_size}


def _meta_gpt2() -> nn.Module:
    with torch.device("meta"):
        model = fm.hf_gpt2()
    model.init_seed = 3  # type: ignore[assignment]
    return model


def check_gpt2_meta() -> dict:
    """GPT-2 built on the meta device, parallelized by the hand plan, then materialised: each rank reads only its
    pieces (the transposed head split: its columns of q, k and v), and the gathered state equals ``sw.materialize``
    of the same meta model on one process."""
    m = mesh(tp=2)
    ref = sw.materialize(_meta_gpt2(), "cpu").state_dict()
    model = sw.materialize(sw.parallelize(_meta_gpt2(), m, GPT2_PLAN, axis="tp"), m)
    full = sw.full_state_dict(model)
    differs = [k for k, v in ref.items() if not torch.equal(full[k], v)]
    return {"differs": differs, "keys": sorted(full) == sorted(ref),
            "c_attn": tuple(model.transformer.h[0].attn.c_attn.weight.shape)}
