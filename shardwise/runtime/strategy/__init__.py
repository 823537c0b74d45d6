"""The trainer's parallel layouts behind one protocol (``base.Strategy``), and ``build_strategy``, the one place
that picks a layout from the config."""

from __future__ import annotations

import torch

from ...mesh import Mesh
from ..compiling import CompileWatch, compile_model
from ..config import Config, ParallelConfig
from ..experts import setup_experts
from ..model_build import meta_model_for
from .base import Strategy, build_optimizer, tensor_parallel
from .pipeline import PipelineStrategy
from .plain import PlainStrategy
from .zero import ZeroStrategy

__all__ = ["Strategy", "build_strategy", "mesh_axes", "build_optimizer", "tensor_parallel", "PlainStrategy", "ZeroStrategy",
           "PipelineStrategy"]


def mesh_axes(p: ParallelConfig) -> dict[str, int]:
    """``(dp, tp)``; with pipeline parallelism ``(pp, dp, tp)``: stages outermost, so a stage's dp/tp peers are
    neighbouring ranks. (pp = 1 keeps the 2-axis mesh, and so the index of every non-pipeline checkpoint.) With
    context parallelism the ``dp`` axis is ``dp × cp`` wide: the cp ranks are data-parallel replicas of their
    sequence chunks to every strategy (``runtime/context_split.py``)."""
    dp = p.dp * p.cp
    return dict(pp=p.pp, dp=dp, tp=p.tp) if p.pp > 1 else dict(dp=dp, tp=p.tp)


def build_strategy(cfg: Config, mesh: Mesh) -> Strategy:
    """The model of ``cfg.model`` — the reference GPT, or the HF decoder of ``model.hf_config`` — run by the layout
    of ``cfg.parallel``. Built on the meta device (``meta_model_for``): each rank materialises only what its layout
    keeps, with the values one device has (same seed, or the pretrained directory's tensors) — ``cfg.parallel``: a pipeline when ``pp > 1`` (tp, ZeRO-1 and activation checkpointing inside its stages),
    else ``sw.zero`` when ``zero_stage > 0``, else plain / ``DataParallel`` / tensor parallel. A mixture of experts
    first gets its ``Experts`` (``runtime/experts.py``: with ``parallel.ep > 1`` the expert mesh and the cut),
    handed to the strategy as ``experts``. Collective (the wrappers broadcast or check the weights over their
    axes; the expert mesh's groups)."""
    plain = meta_model_for(cfg)
    p = cfg.parallel
    # MoE: the experts cut over the expert mesh (parallel.ep) before any wrapper sees the model; None if dense
    experts = setup_experts(cfg, mesh, plain)
    more = {"experts": experts} if experts is not None else {}
    strategy: Strategy
    if p.pp > 1:
        strategy = PipelineStrategy(cfg, mesh, plain, **more)
    elif p.zero_stage:
        strategy = ZeroStrategy(cfg, mesh, plain, experts)
    else:
        strategy = PlainStrategy(cfg, mesh, plain, experts)
    strategy.experts = experts  # type: ignore[attr-defined]  # the trainer's per-step calls (runtime/experts.py)
    if p.pp == 1:  # train.compile: last, over every wrapper (a pipeline compiles before cutting: pipeline.py)
        compile_model(cfg, strategy.plain)
    strategy.compiled = CompileWatch(strategy.plain)  # type: ignore[attr-defined]  # the trainer's reports
    pretrained = getattr(plain, "_shardwise_pretrained", None)
    strategy.pretrained_bytes_read = pretrained.bytes_read if pretrained is not None else 0  # type: ignore[attr-defined]
    return strategy
