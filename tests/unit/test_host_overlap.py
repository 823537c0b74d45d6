"""The step read one step late (``runtime/host_overlap.py``), forced on CPU: the path CUDA takes — the non-finite
flag handed to the fused optimizer as ``found_inf``, the loss left as a tensor and read after the next step is
queued — gives the same metrics records, weights and skip decisions as reading each step at once.

In-process on a world of one (``sw.init``); a tiny GPT, a few steps per run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise.runtime import host_overlap, trainer as trainer_mod
from shardwise.runtime.config import load_config, validate
from shardwise.runtime.nonfinite import NonFiniteError
from shardwise.runtime.optimizer_impl import supports_found_inf

SMALL = {"parallel.nproc": "1", "data.global_batch": "4", "parallel.micro_batch": "2", "model.n_layer": "2",
         "model.n_embd": "32", "model.n_head": "2", "model.block_size": "16", "optimizer.warmup_steps": "2",
         "train.steps": "6", "optimizer.implementation": "fused"}


@pytest.fixture(scope="module")
def world() -> Iterator[sw.World]:
    created = not dist.is_initialized()
    w = sw.init(backend="gloo")
    yield w
    if created:
        dist.destroy_process_group()


def _run(world: sw.World, tmp: Path, defer: bool, log: list[str] | None = None,
         **extra: str) -> tuple[list[dict[str, Any]], dict[str, torch.Tensor]]:
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = validate(load_config(overrides={**SMALL, **extra}))
    t = trainer_mod.Trainer(cfg, tmp, world)
    assert not t.overlap  # CPU: read at once unless forced
    t.overlap = defer
    if log is not None:  # the order of launches and reads
        launch, read = t.launch_step, host_overlap.read

        def launch_step(*, defer: bool) -> Any:
            p = launch(defer=defer)
            log.append(f"launch {p.step}")
            return p
        t.launch_step = launch_step  # type: ignore[method-assign]
        trainer_mod.read = lambda p, since: (log.append(f"read {p.step}"), read(p, since))[1]  # type: ignore
    try:
        t.run(save=False)
    finally:
        trainer_mod.read = host_overlap.read
    records = [json.loads(line) for line in (tmp / "metrics.jsonl").read_text().splitlines()]
    return records, {k: v.detach().clone() for k, v in t.plain.state_dict().items()}


def _same(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    keys = ("step", "loss", "lr", "tokens", "skipped")
    assert [{k: r[k] for k in keys} for r in a] == [{k: r[k] for k in keys} for r in b]


def test_deferred_reads_match_immediate_ones(world: sw.World, tmp_path: Path) -> None:
    now, w_now = _run(world, tmp_path / "now", defer=False)
    log: list[str] = []
    late, w_late = _run(world, tmp_path / "late", defer=True, log=log)
    _same(now, late)
    assert [r["step"] for r in late] == list(range(1, 7))
    assert all(torch.equal(w_now[k], w_late[k]) for k in w_now)
    # step 1 is read at once (the memory report); later steps are read after the next one is launched,
    # the last at once
    assert log == ["launch 1", "launch 2", "launch 3", "read 2", "launch 4", "read 3", "launch 5", "read 4",
                   "launch 6", "read 5", "read 6"]
    assert "host_wait_s" not in now[-1] and late[-1]["host_wait_s"] >= 0 and "host_wait_s" not in late[0]
    assert all(r["step_s"] > 0 and r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in late)


def test_deferred_skip_leaves_the_step_out_on_the_device(world: sw.World, tmp_path: Path) -> None:
    fault = {"debug.nonfinite_step": "3", "train.nonfinite": "skip"}
    now, w_now = _run(world, tmp_path / "now", defer=False, **fault)
    late, w_late = _run(world, tmp_path / "late", defer=True, **fault)
    assert [r["skipped"] for r in late] == [False, False, True, False, False, False]
    _same(now, late)
    assert all(torch.equal(w_now[k], w_late[k]) for k in w_now)


def test_deferred_stop_names_the_step_that_failed(world: sw.World, tmp_path: Path) -> None:
    with pytest.raises(NonFiniteError, match="at step 3: loss nan, first non-finite gradient on this rank: not named"):
        _run(world, tmp_path, defer=True, **{"debug.nonfinite_step": "3"})


def test_only_cuda_fused_unclipped_data_parallel_steps_are_read_late() -> None:
    from types import SimpleNamespace

    from shardwise.runtime.strategy import PipelineStrategy, PlainStrategy, build_optimizer

    cfg = validate(load_config(overrides=SMALL))
    params = [torch.nn.Parameter(torch.zeros(2))]

    def strategy(kind: type, how: str) -> Any:
        s = object.__new__(kind)  # only the optimizer matters here
        s.optimizer = build_optimizer(params, dataclasses.replace(cfg.optimizer, implementation=how))
        return s
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert host_overlap.can_defer(strategy(PlainStrategy, "fused"), cuda, cfg)
    assert not host_overlap.can_defer(strategy(PlainStrategy, "fused"), cpu, cfg)
    assert not host_overlap.can_defer(strategy(PlainStrategy, "foreach"), cuda, cfg)
    assert not host_overlap.can_defer(strategy(PipelineStrategy, "fused"), cuda, cfg)
    clipped = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, clip_grad_norm=1.0))
    assert not host_overlap.can_defer(strategy(PlainStrategy, "fused"), cuda, clipped)
    inner = strategy(PlainStrategy, "fused").optimizer
    assert supports_found_inf(SimpleNamespace(optimizer=inner))  # a ZeroOptimizer: its inner optimizer is fused
