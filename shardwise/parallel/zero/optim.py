"""The optimizer half of ``sw.zero``: any ``torch.optim`` optimizer run on this rank's flat shards.

The inner optimizer sees one ``nn.Parameter`` per flat group: this rank's ``master`` shard (fp32, or the
model's dtype). Its state (AdamW's m and v) therefore exists only for the shard — 1/N of the model.
Element-wise optimizers (SGD, Adam/AdamW, RMSprop, Adagrad, ...) give exactly the single-device update;
optimizers that look at whole tensors (per-tensor trust ratios, LBFGS) see one flat tensor per group.
Every param group gets the factory's hyperparameters.

``step()`` (collective): take the averaged gradient shards (reduced during backward), unscale and check for
overflow (fp16), run the inner step on the shards, copy the master shard into the compute shard (mixed
precision) and, for stages 1-2, all-gather the updated parameters. Stage 3 gathers at the next forward.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ... import comm
from ...mesh import Mesh
from ..common.grad_norm import clip_counted, shard_pieces
from ..common.mixed_precision import LossScaler
from .flat import FlatGroup
from .groups import ZeroGroups
from .offload import GradientToHost

__all__ = ["ZeroOptimizer", "OptimizerFactory", "make_inner_optimizer"]

OptimizerFactory = Callable[..., torch.optim.Optimizer]
"""What ``sw.zero(optimizer=...)`` takes: called once with this rank's list of flat shard parameters."""


def make_inner_optimizer(factory: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Call ``factory(params)`` and check that it built a ``torch.optim.Optimizer``."""
    if isinstance(factory, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a factory (e.g. functools.partial(torch.optim.AdamW, lr=1e-3)), "
                        f"not an already built {type(factory).__name__}: ZeRO builds it on this rank's shards")
    if not callable(factory):
        raise TypeError(f"optimizer must be a callable returning a torch.optim.Optimizer, got "
                        f"{type(factory).__name__}; e.g. functools.partial(torch.optim.SGD, lr=0.1)")
    if isinstance(factory, type) and not issubclass(factory, torch.optim.Optimizer):
        raise TypeError(f"optimizer class {factory.__name__} is not a torch.optim.Optimizer subclass; "
                        f"pass e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")
    built = factory(params)
    if not isinstance(built, torch.optim.Optimizer):
        raise TypeError(f"optimizer factory returned {type(built).__name__}, not a torch.optim.Optimizer; "
                        f"pass e.g. functools.partial(torch.optim.AdamW, lr=1e-3)")
    return built


class ZeroOptimizer:
    """Returned by ``sw.zero``; drives the inner optimizer on the shards (see module docstring)."""

    def __init__(self, owner: ZeroGroups, factory: Any, groups: list[FlatGroup], mesh: Mesh, axis: str, *,
                 stage: int, scaler: LossScaler, reduce_dtype: torch.dtype,
                 to_host: GradientToHost | None = None) -> None:
        self._owner = owner  # its no_sync state and gradient buffers (``ZeroGroups``: public accessors only)
        self.groups, self.mesh, self.axis, self.stage = groups, mesh, axis, stage
        self.scaler, self.reduce_dtype = scaler, reduce_dtype
        self.optimizer = make_inner_optimizer(factory, [g.master for g in groups])
        self.to_host = to_host
        """Offload: the gradient shards' copies into the host masters' ``.grad`` (``offload.py``), or None."""
        self._ready = False  # master.grad holds this step's averaged, unscaled gradients
        self._overflow = False

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's param groups (change ``lr`` here)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without fp16 scaling)."""
        return self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale``: call ``opt.scale_loss(loss).backward()`` with fp16 (harmless otherwise)."""
        return loss * self.scaler.scale if self.scaler.scale != 1.0 else loss

    # -- gradients ------------------------------------------------------------------------------------
    def _check_sync(self, what: str) -> None:
        owner = self._owner
        if not owner.syncing:
            raise RuntimeError(f"{what} called inside no_sync(): gradients accumulated there are local to "
                               f"each rank; leave the no_sync() block and run the last micro-batch's "
                               f"backward outside it, then call {what}")
        if owner.has_unreduced_grads:
            raise RuntimeError(f"{what}: gradients accumulated under no_sync() were never reduced; run one "
                               f"backward outside no_sync() (the last micro-batch) before {what}")

    @torch.no_grad()
    def _prepare_grads(self) -> None:
        """Put this step's averaged, unscaled gradient shard (master dtype) into every ``master.grad``: the
        owner's shards, reduced during backward (no communication here; with loss scaling, the overflow
        flag's all-reduce, collective)."""
        if self._ready:
            return
        shards = list(self._owner.shard_grads)
        if self.to_host is not None:
            self.to_host.wait()  # the copies started as each shard was stored (offload: overlapped with backward)
        for g, shard in zip(self.groups, shards):
            if shard.device != g.master.device:  # offloaded: into the host buffer (started in backward, or now)
                if g.master.grad is None or id(g) not in self.to_host.copied:  # type: ignore[union-attr]
                    g.master.grad = shard.to(device=g.master.device, dtype=g.master.dtype)
                continue
            g.master.grad = shard if shard.dtype == g.master.dtype else shard.to(g.master.dtype)
            if self.scaler.scale != 1.0:
                g.master.grad.div_(self.scaler.scale)
        self._overflow = self._check_overflow() if self.scaler.scale != 1.0 else False
        self._ready = True
        self._owner.set_grads_prepared(True)

    def _check_overflow(self) -> bool:
        local = any(not bool(torch.isfinite(g.master.grad).all()) for g in self.groups if g.master.grad is not None)
        flag = torch.tensor([1.0 if local else 0.0], device=self.mesh.device)
        comm.all_reduce(flag, self.mesh, self.axis, op="max")
        return bool(flag.item() > 0)

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the gradients so that their norm over the *whole* model (all shards of all ranks) is at
        most ``max_norm``; returns that total norm (before clipping), like
        ``torch.nn.utils.clip_grad_norm_`` on one device. With tensor parallelism inside (the mesh's other
        axes) a tp-split parameter's shard counts on every tp coordinate, a replicated one (layer norms, a
        row-parallel bias) on tp coordinate 0 only (``common/grad_norm.py``). Collective: one all-reduce of
        one number per mesh axis of size > 1."""
        self._check_sync("clip_grad_norm_")
        self._prepare_grads()
        scale = [g.master.grad for g in self.groups if g.master.grad is not None]
        count = shard_pieces(self.groups, [g.master.grad for g in self.groups], self.mesh, self.axis, {self.axis})
        return clip_counted(count, scale, mesh=self.mesh, max_norm=max_norm, norm_type=norm_type)

    # -- step -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """One optimizer step on the shards, then refresh the compute parameters. The step consumes the
        gradients: afterwards every gradient buffer is zero (``zero_grad()`` is optional). Returns False
        when the step was skipped (fp16 overflow). Collective."""
        self._check_sync("step()")
        self._prepare_grads()
        overflow = self._overflow
        if not overflow:
            self.optimizer.step()
            for g in self.groups:
                if g.shard.data_ptr() != g.master.data_ptr():
                    g.shard.copy_(g.master)
            if self.stage in (1, 2):
                handles = [g.start_gather() for g in self.groups]
                for g, h in zip(self.groups, handles):
                    g.finish_gather(h)
        self.scaler.update(overflow)
        self._owner.after_step()
        self.zero_grad()  # a step consumes its gradients (every stage alike)
        return not overflow

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this step's gradients: the owner's buffers count as zero from now on (``sw.zero``: every
        ``param.grad`` becomes ``None``; persistent buffers are overwritten by the next backward, never
        reallocated) and ``master.grad`` is dropped. ``set_to_none`` is accepted for compatibility. Local."""
        self._owner.clear_grads()
        for g in self.groups:
            g.master.grad = None
        if self.to_host is not None:
            self.to_host.copied.clear()
        self._ready = False
        self._owner.set_grads_prepared(False)

    def state_dict(self) -> dict[str, Any]:
        """This rank's inner optimizer state (its shards only) plus the loss scale. Local."""
        return {"inner": self.optimizer.state_dict(), "loss_scale": self.scaler.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on the same rank, stage and world size. Local."""
        self.optimizer.load_state_dict(state["inner"])
        self.scaler.scale = float(state["loss_scale"])
