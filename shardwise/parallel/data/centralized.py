"""The centralised baseline: classic single-server data parallelism, kept to be measured against.

Every replica computes gradients on its micro-batch; the gradients are *reduced to one root rank* (one
flat ``reduce`` per dtype), the root alone runs the optimizer, and the updated parameters are *broadcast*
back. The root's link carries all traffic — ``2·(n-1)`` gradient-sized messages per step through one
rank, against ``2·(n-1)/n`` of a gradient per rank for a ring all-reduce — and nothing overlaps with
backward, which is why all-reduce data parallelism (``DataParallel``) beats it.

    model = CentralizedDataParallel(net, mesh, axis="dp", optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    loss_fn(model(x_local), y_local).backward()
    model.step()        # collective: reduce to root, root steps, broadcast parameters
    model.zero_grad()
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from ...comm.counter import record_collective
from ...mesh import Mesh
from .replicas import broadcast_coalesced, check_module, check_replicas_agree, trainable

__all__ = ["CentralizedDataParallel"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class CentralizedDataParallel(nn.Module):
    """Gradients reduced to coordinate ``root`` of ``axis``, optimizer there, parameters broadcast back.
    Construction is collective (signature check and broadcast from ``root``)."""

    def __init__(self, module: nn.Module, mesh: Mesh, axis: str = "dp", *, optimizer: OptimizerFactory,
                 root: int = 0, broadcast_buffers: bool = True) -> None:
        check_module(module, mesh, axis)
        if not 0 <= root < mesh.size(axis):
            raise ValueError(f"root {root} is not a coordinate of axis {axis!r} (size {mesh.size(axis)})")
        if not callable(optimizer):
            raise TypeError("optimizer must be a factory: a callable taking the parameters, "
                            "e.g. lambda ps: torch.optim.SGD(ps, lr=0.1)")
        super().__init__()
        self.module, self.mesh, self.axis, self.root = module, mesh, axis, root
        self.broadcast_buffers = broadcast_buffers
        check_replicas_agree(module, mesh, axis)
        broadcast_coalesced([*module.parameters(), *module.buffers()], mesh, axis, src=root)
        self.params = [p for _, p in trainable(module)]
        self.is_root = mesh.coord(axis) == root
        # Only the root holds optimizer state: that is the point (and the memory cost) of the design.
        self.optimizer = optimizer(self.params) if self.is_root else None
        module._shardwise_data_parallel = True  # type: ignore[assignment]
        self._shardwise_data_parallel = True

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                broadcast_coalesced(buffers, self.mesh, self.axis, src=self.root)
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def step(self) -> None:
        """Reduce gradients to the root, step the optimizer there, broadcast the parameters. Collective."""
        groups: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault(p.dtype, []).append(p)
        n = self.mesh.size(self.axis)
        dst = self.mesh.global_rank(self.axis, self.root)
        for members in groups.values():
            # (sum of member numels,) flat gradient; a missing gradient counts as zero.
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in members])
            record_collective("reduce", "native", self.axis, flat.numel() * flat.element_size(), n)
            dist.reduce(flat, dst=dst, op=dist.ReduceOp.SUM, group=self.mesh.group(self.axis))
            if self.is_root:
                flat.div_(n)
                pos = 0
                for p in members:
                    p.grad = flat[pos:pos + p.numel()].view(p.shape)
                    pos += p.numel()
        if self.optimizer is not None:
            self.optimizer.step()
        broadcast_coalesced(self.params, self.mesh, self.axis, src=self.root)

    def zero_grad(self, set_to_none: bool = True) -> None:  # type: ignore[override]
        self.module.zero_grad(set_to_none=set_to_none)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)
