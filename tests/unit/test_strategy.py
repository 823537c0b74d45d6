"""``build_strategy`` picks one layout from the config, and each strategy answers the protocol on a world of
one process (the multi-rank behaviour is covered against one device in tests/dist and tests/e2e)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise.mesh import Mesh
from shardwise.models.gpt import GPT
from shardwise.runtime.config import Config, validate
from shardwise.runtime.strategy import PlainStrategy, ZeroStrategy, build_strategy


@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def _cfg(**parallel) -> Config:
    cfg = Config()
    return validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, nproc=1, **parallel)))


@pytest.mark.parametrize("zero_stage, kind", [(0, PlainStrategy), (1, ZeroStrategy), (3, ZeroStrategy)])
def test_build_picks_the_layout_and_reports_memory(mesh, zero_stage, kind):
    cfg = _cfg(zero_stage=zero_stage)
    s = build_strategy(cfg, mesh)
    assert isinstance(s, kind)
    assert all(callable(getattr(s, m)) for m in ("passes", "mean_loss", "grads", "pieces", "load", "memory"))
    with torch.device("meta"):  # the model's size from its config (ZeRO-3 releases the plain module's storage)
        numel = sum(p.numel() for p in GPT(cfg.model).parameters())
    mem = s.memory()
    assert set(mem) >= {"params", "grads", "optimizer", "peak"}
    assert mem["params"] >= 4 * numel  # fp32 weights, held whole on a world of one
    # before any step: no optimizer state; gradients none (plain; ZeRO-2/3 allocate their shards in backward and
    # release them at the step) or ZeRO-1's persistent fp32 flat buffers
    assert mem["optimizer"] == 0 and mem["grads"] == (4 * numel if zero_stage == 1 else 0)


def test_one_step_through_the_protocol_matches_plain_torch(mesh):
    s = build_strategy(_cfg(), mesh)
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 64))
    batches = [(x, torch.roll(x, -1, 1))]
    times = {"fwd": 0.0, "bwd": 0.0, "comm": 0.0}
    loss = s.passes(batches, times, lambda: None, poison=False)
    grads = s.grads()
    assert grads and all(torch.isfinite(g.tensor).all() for g in grads)
    assert s.mean_loss(loss) == pytest.approx(float(loss))
    names = {k for p in s.pieces() for k in [p.key]}
    assert any(k.startswith("model/") for k in names)


def test_mesh_timeout_must_be_positive_and_gives_its_own_groups(mesh):
    with pytest.raises(ValueError, match=r"timeout_s=0\b.*> 0 seconds"):
        Mesh(dp=1, timeout_s=0)
    short = Mesh(dp=1, timeout_s=7.5)
    assert short.timeout_s == 7.5 and mesh.timeout_s is None


@pytest.mark.parametrize("algorithm, want", [("tree", "tree"), ("native", "native"), ("auto", "ring")])
def test_zero_takes_parallel_algorithm(mesh, algorithm, want):
    # a named algorithm reaches sw.zero's collectives; auto without a calibration keeps ZeRO's CPU default (the ring)
    s = build_strategy(_cfg(zero_stage=1, algorithm=algorithm), mesh)
    assert isinstance(s, ZeroStrategy) and s.model.algorithm == want


def test_the_launch_header_names_the_model_shape():
    from pathlib import Path

    from shardwise.cli.train import _header

    cfg = _cfg()
    line = _header(cfg, Path("runs/x"), None)
    shape = f"({cfg.model.n_layer} layers × {cfg.model.n_embd} wide)"
    assert line.startswith(f"shardwise train: {cfg.train.name} {shape} on 1 ")
