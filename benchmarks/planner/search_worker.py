"""One rank of ``benchmarks/planner_search_measured.py`` for the non-transformer model: a deep residual MLP
laid out as one planner ``Layout`` (dp × pp × ZeRO × micro-batch × schedule × checkpointing) with the public
strategies — ``DataParallel``, ``sw.zero``, ``sw.pipeline``, ``sw.checkpoint_layers`` — and timed like
``shardwise train`` times its steps (median after the first two, AdamW, one tiny loss all-reduce per step).

The model is an ``nn.Sequential`` of units (input projection, residual MLP blocks, head), so the planner's
trace (``ModelSpec.trace``) and ``sw.pipeline`` cut it at the same names (``"0"``, ``"1"``, …) and the plan's
``pp_split`` applies as it is. Run under torchrun: ``shardwise run -n 4 -m benchmarks.planner.search_worker
--model JSON --plan JSON --global-batch B --steps N --out DIR``; each rank writes ``DIR/rankN.json``.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLPConfig", "build_mlp", "mlp_spec", "main"]


@dataclass(frozen=True)
class MLPConfig:
    """The deep MLP's shape: ``inputs → width``, ``depth`` residual blocks ``width → hidden → width``, a head."""

    inputs: int = 256
    width: int = 512
    hidden: int = 2048
    depth: int = 8
    classes: int = 256


class ResidualMLP(nn.Module):
    """``x + proj(gelu(fc(norm(x))))``: a pre-norm MLP block, the unit a pipeline stage boundary falls between."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(width), nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


def build_mlp(cfg: MLPConfig) -> nn.Sequential:
    head = nn.Sequential(nn.LayerNorm(cfg.width), nn.Linear(cfg.width, cfg.classes))
    return nn.Sequential(nn.Linear(cfg.inputs, cfg.width),
                         *[ResidualMLP(cfg.width, cfg.hidden) for _ in range(cfg.depth)], head)


def mlp_spec(cfg: MLPConfig) -> Any:
    """The planner's ``ModelSpec`` of ``build_mlp(cfg)``, traced (no tp plan), the loss included in the head."""
    from shardwise.planner import ModelSpec

    def loss(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, torch.zeros(out.shape[0], dtype=torch.long, device=out.device))

    return ModelSpec.trace(build_mlp(cfg), (torch.zeros(8, cfg.inputs),), loss_fn=loss, name="deep-mlp")


# -- inside a rank ----------------------------------------------------------------------------------------
def _blocks(model: nn.Sequential) -> Callable[[str, nn.Module], bool]:
    """The residual blocks (top-level children 1 … n-2): what the planner recomputes under ``full``."""
    names = {str(i) for i in range(1, len(model) - 1)}
    return lambda name, _module: name in names


def _layout(model: nn.Sequential, plan: Any, mesh: Any, adamw: Any) -> tuple[Any, Any, Callable[..., float]]:
    """``(model, optimizer, passes)``: the plan built with the public strategies; ``passes(x, y)`` runs one
    step's forward/backward passes on the full global batch and returns this rank's loss."""
    from shardwise.parallel.common.activation_checkpointing import checkpoint_layers
    from shardwise.parallel.data.data_parallel import DataParallel
    from shardwise.parallel.pipeline.build import pipeline
    from shardwise.parallel.zero.wrap import zero

    accum = plan.grad_accum
    if plan.pp > 1:
        pipe = pipeline(model, mesh, "pp", microbatches=plan.microbatches, schedule=plan.schedule,
                        loss_fn=lambda out, y: F.cross_entropy(out, y) / accum, split=list(plan.pp_split) or None,
                        chunks=plan.chunks, dp_axis="dp", zero_stage=plan.zero_stage,
                        checkpoint=plan.activation_checkpointing == "full")
        # every rank passes each pass's micro_batch × microbatches × dp samples; the pipeline slices dp itself
        return pipe, pipe.build_optimizer(adamw), lambda x, y: sum(
            pipe.step(xs, ys) for xs, ys in zip(x.chunk(accum), y.chunk(accum)))
    if plan.activation_checkpointing == "full":
        checkpoint_layers(model, policy=_blocks(model))
    if plan.zero_stage:
        from shardwise.runtime.strategy.zero import zero_algorithm

        units = [[str(i)] for i in range(len(model))]  # each unit gathered on its own, as the planner assumes
        # collectives chosen as `shardwise train` chooses them (parallel.algorithm auto, the given calibration)
        wrapped, opt = zero(model, mesh, stage=plan.zero_stage, axis="dp", optimizer=adamw,
                            units=units if plan.zero_stage == 3 else None, algorithm=zero_algorithm("auto", mesh))
    else:
        wrapped = DataParallel(model, mesh, axis="dp", algorithm="auto") if plan.dp > 1 else model
        opt = adamw(list(model.parameters()))
    return wrapped, opt, functools.partial(_accumulate, wrapped, mesh, accum)


def _accumulate(model: Any, mesh: Any, accum: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """This rank's dp shard in ``accum`` passes, the reduction on the last only (``no_sync`` before)."""
    dp, me = mesh.size("dp"), mesh.coord("dp")
    xs, ys = x.chunk(dp)[me].chunk(accum), y.chunk(dp)[me].chunk(accum)
    total = 0.0
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        last = i == accum - 1
        ctx = model.no_sync() if not last and hasattr(model, "no_sync") else _Null()
        with ctx:
            loss = F.cross_entropy(model(xi), yi) / accum
            loss.backward()
        total += float(loss)
    return total


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _memory(model: Any, opt: Any) -> int:
    """Model states of this rank (parameters, gradients, optimizer state), each storage once."""
    from shardwise.parallel.common.memory import memory_report, storage_bytes
    from shardwise.parallel.pipeline.build import Pipeline

    if isinstance(model, Pipeline):  # a pipeline: its stages' parameters and the dp gradient buffers
        params = list(model.parameters())
        sync = model.grad_sync
        grads = [q.grad for q in params] + ([*sync.full_grads, *sync.held_shards()] if sync is not None else [])
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return sum(storage_bytes({"params": params, "grads": grads, "optimizer": state}).values())
    report = memory_report(model, opt)
    return sum(report[k] for k in ("params", "grads", "optimizer"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed as dist

    from shardwise.mesh import Mesh
    from shardwise.parallel.common.saved_memory import SavedTensorPeak
    from shardwise.planner import Layout
    from shardwise.world import init

    world = init()
    cfg, plan = MLPConfig(**json.loads(args.model)), Layout.from_json(args.plan).resolved(args.global_batch)
    from shardwise.comm.hardware import hardware_collectives, load_hardware_calibration

    cals = hardware_collectives(load_hardware_calibration(args.calibration)) if args.calibration else []
    mesh = Mesh(pp=plan.pp, dp=plan.dp, calibration=cals) if plan.pp > 1 else Mesh(dp=plan.dp, calibration=cals)
    torch.manual_seed(0)  # the same weights on every rank
    model = build_mlp(cfg)
    adamw = functools.partial(torch.optim.AdamW, lr=1e-4)
    wrapped, opt, passes = _layout(model, plan, mesh, adamw)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.global_batch, cfg.inputs, generator=gen), torch.randint(cfg.classes, (args.global_batch,), generator=gen)
    saved, times, states = SavedTensorPeak(), [], 0
    for step in range(args.steps):
        start = time.perf_counter()
        with saved:
            loss = torch.tensor([passes(x, y)])
        opt.step()
        if step == 0:  # gradients and optimizer state all live, as ``shardwise train`` measures
            states = _memory(wrapped, opt)
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(loss)  # like train's loss mean: every step ends on a collective
        times.append(time.perf_counter() - start)
    steady = times[2:] if len(times) > 2 else times
    return {"rank": world.rank, "step_s": statistics.median(steady), "times": times,
            "model_state_bytes": states, "activation_peak_bytes": saved.peak, "plan": plan.to_json()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.planner.search_worker")
    parser.add_argument("--model", default=json.dumps(asdict(MLPConfig())), help="MLPConfig as JSON")
    parser.add_argument("--plan", required=True, help="planner Layout as JSON")
    parser.add_argument("--global-batch", type=int, required=True)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", required=True, help="directory for rankN.json")
    parser.add_argument("--calibration", default="", help="hardware file whose collectives algorithm auto picks from "
                        "(as `shardwise train --parallel.calibration`)")
    args = parser.parse_args(argv)
    from shardwise.world import shutdown

    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result))
    shutdown()  # a barrier first: a rank tearing down with a peer's traffic in flight dies with SIGABRT
    return 0


if __name__ == "__main__":
    from shardwise.world import exit_process

    exit_process(main())
