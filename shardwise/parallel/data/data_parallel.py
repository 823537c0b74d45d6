"""``sw.DataParallel``: replicate a model over one mesh axis and average gradients (or parameters).

SBP view: the batch is ``S(0)`` over the axis, parameters are ``B``, gradients come out of backward as
``P`` and are all-reduced back to ``B`` — bucketed, and overlapped with backward (``reducer.py``).

    model = sw.DataParallel(model, mesh, axis="dp")
    loss_fn(model(x_local), y_local).backward()   # gradients are averaged when backward returns
    opt.step(); opt.zero_grad()

Collective calls: construction (signature check + broadcast), every forward when buffers are broadcast,
every synchronised backward, the first forward after the first backward (bucket rebuild, once), and
``average_parameters`` on averaging steps. Every rank of the axis must make them in the same sequence.

``state_dict()``/``load_state_dict()`` of the wrapper use the plain model's keys (no ``module.`` prefix), so
a checkpoint saved from the wrapper loads into the unwrapped model and vice versa; ``named_parameters()``
still shows the ``module.`` prefix, as for any ``nn.Module`` attribute.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Literal, Mapping

import torch
import torch.nn as nn

from ...comm.ops import ALGORITHM_CHOICES
from ...mesh import Mesh
from .comm_hooks import CommHook
from .centralized import CentralizedDataParallel
from .comm_stats import CommStats
from .local_sgd import ParameterAverager
from .reducer import GradientReducer
from ..common.materialize import ensure_sources, materialize, needs_broadcast
from .replicas import broadcast_coalesced, check_module, check_replicas_agree, trainable

__all__ = ["DataParallel", "CentralizedDataParallel"]

AVERAGES = ("gradients", "parameters")


def _check_options(bucket_cap_mb: float, first_bucket_mb: float, algorithm: str, average: str, period: int) -> None:
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a number > 0 (megabytes), got {value!r}; e.g. {name}=25")
    if algorithm not in ALGORITHM_CHOICES:
        raise ValueError(f"unknown algorithm {algorithm!r}; choose one of {list(ALGORITHM_CHOICES)}")
    if average not in AVERAGES:
        raise ValueError(f"unknown average {average!r}; choose 'gradients' (all-reduce every backward) or "
                         f"'parameters' (local SGD: average the parameters every `period` optimizer steps)")
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
        raise ValueError(f"period must be an int >= 1 (optimizer steps between parameter averages), got {period!r}")
    if average == "gradients" and period != 1:
        raise ValueError(f"period={period} only applies to average='parameters'; gradient averaging "
                         f"synchronises every backward (use no_sync() to accumulate)")


class DataParallel(nn.Module):
    """Data parallelism over ``axis`` of ``mesh`` (see module docstring).

    ``bucket_cap_mb``/``first_bucket_mb``: gradient bucket sizes (MB = 2**20 bytes). ``overlap``: start a
    bucket's all-reduce during backward as soon as its gradients are ready (else all after backward).
    ``algorithm``: ``native | ring | tree | shm | auto`` collective (``shm``: through shared memory, every rank
    of the axis on one host; ``auto``: per bucket, the cheapest by the mesh's calibration; native without one). ``find_unused_parameters``: parameters without a
    gradient in a backward contribute zero instead of raising. ``broadcast_buffers``: copy coordinate 0's
    buffers to every replica at each forward. ``average``: ``"gradients"`` or ``"parameters"`` (local SGD,
    every ``period`` calls of ``average_parameters()``). ``grad_views``: ``param.grad`` aliases the buckets.
    Collective (signature check and initial broadcast of parameters and buffers from coordinate 0).
    """

    def __init__(self, module: nn.Module, mesh: Mesh, axis: str = "dp", *, bucket_cap_mb: float = 25,
                 first_bucket_mb: float = 1, overlap: bool = True,
                 algorithm: Literal["native", "ring", "tree", "shm", "auto"] = "native",
                 find_unused_parameters: bool = False, broadcast_buffers: bool = True,
                 average: Literal["gradients", "parameters"] = "gradients", period: int = 1,
                 grad_views: bool = True) -> None:
        check_module(module, mesh, axis)
        _check_options(bucket_cap_mb, first_bucket_mb, algorithm, average, period)
        real = [t for t in (*module.parameters(), *module.buffers()) if needs_broadcast(t)]
        ensure_sources(module)  # a meta-device model: every replica draws the same values from the same sources
        super().__init__()
        self.module = module
        self.mesh, self.axis, self.algorithm, self.average = mesh, axis, algorithm, average
        self.broadcast_buffers = broadcast_buffers
        self._sync_enabled = True
        check_replicas_agree(module, mesh, axis)  # includes the sources' seeds
        materialize(module, mesh.device)
        broadcast_coalesced(real, mesh, axis, src=0)  # values drawn from sources agree by construction
        params = trainable(module)
        self._reducer: GradientReducer | None = None
        self._averager: ParameterAverager | None = None
        if average == "gradients":
            self._reducer = GradientReducer(
                params, mesh, axis, cap_bytes=max(1, int(bucket_cap_mb * 2**20)),
                first_cap_bytes=max(1, int(first_bucket_mb * 2**20)),
                overlap=overlap, algorithm=algorithm, find_unused=find_unused_parameters, grad_views=grad_views)
        else:
            self._averager = ParameterAverager([p for _, p in params], mesh, axis, period=period, algorithm=algorithm)
        # Refuse a second wrap, of the model or of this wrapper.
        module._shardwise_data_parallel = True  # type: ignore[assignment]
        self._shardwise_data_parallel = True
        self._register_load_state_dict_pre_hook(_add_module_prefix)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward. Collective when buffers are broadcast or the one-time rebuild is due."""
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_coalesced(buffers, self.mesh, self.axis, src=0)
        if self._reducer is not None and torch.is_grad_enabled():
            self._reducer.prepare_forward(sync=self._sync_enabled)
        return self.module(*args, **kwargs)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients locally, with no communication; the
        next synchronised backward averages the accumulated sum (one large-batch step). Local only."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def register_comm_hook(self, hook: CommHook) -> None:
        """Replace how a bucket is reduced: ``hook(bucket) -> fut`` with ``fut.wait()`` returning the averaged
        flat tensor (see ``shardwise.parallel.data.comm_hooks``). Register before the first backward."""
        if self._reducer is None:
            raise ValueError("comm hooks reduce gradients; this DataParallel averages parameters "
                             "(average='parameters'), which sends no gradients")
        if not callable(hook):
            raise TypeError(f"a comm hook must be callable as hook(bucket), got {type(hook).__name__}")
        self._reducer.hook = hook

    def comm_stats(self, reset: bool = False) -> CommStats:
        """Communication time, exposed (waited-for) time and hidden share, summed over synchronised steps."""
        if self._reducer is None:
            raise ValueError("comm_stats() measures gradient buckets; average='parameters' has none")
        return self._reducer.comm_stats(reset=reset)

    @property
    def bucket_plan(self) -> list[list[str]]:
        """Parameter names of each gradient bucket, in launch order."""
        if self._reducer is None:
            return []
        return [[self._reducer.names[i] for i in b] for b in self._reducer.plan.buckets]

    def average_parameters(self, optimizer: torch.optim.Optimizer | None = None) -> bool:
        """Local SGD: call after every ``optimizer.step()``; every ``period``-th call averages the parameters
        (and ``optimizer``'s per-parameter floating state when given) over the axis. Returns whether it did.
        Collective on averaging calls. Raises ``ValueError`` with ``average='gradients'``."""
        if self._averager is None:
            raise ValueError("average_parameters() needs DataParallel(..., average='parameters'); with "
                             "average='gradients' the gradients are already averaged in backward")
        return self._averager.step(optimizer)

    # -- checkpoints: the plain model's keys --------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _add_module_prefix(state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    # When a parent module loads a state dict that contains this wrapper, keys arrive as prefix + plain key
    # (what state_dict() produced); the wrapped module lives under prefix + "module.".
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(prefix + "module.")]:
        state_dict[prefix + "module." + key[len(prefix):]] = state_dict.pop(key)
