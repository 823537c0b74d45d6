"""Flat shard buffers for ZeRO: a group of parameters laid end to end in one 1-D buffer, cut per rank.

A ``FlatGroup`` owns parameters ``p_0 .. p_{k-1}`` (each once: tied parameters are one object). Their
elements are concatenated in that order into a flat buffer of ``L = sum(numel)`` elements, and the buffer
is cut into ``N`` contiguous shards by the one uneven rule of the project, ``shard_sizes(L, N)`` (the
first ``L % N`` ranks own one extra element). Rank ``i`` owns elements ``[lo, hi)``. In SBP terms the
flat buffer is ``B`` (full, stages 1-2) or ``S(0)`` (stage 3) and the rank's shard is its piece of ``S(0)``.

The module's parameters stay the same ``nn.Parameter`` objects (names, ``state_dict`` keys, autograd
leaves and hooks are unchanged) but their ``.data`` becomes a view into ``full``:

- stages 1-2: ``full`` lives all the time;
- stage 3: ``full``'s storage is resized to 0 bytes when the group is freed and every parameter's ``.data``
  is swapped to an empty tensor (so touching a freed parameter reads an empty tensor instead of freed
  memory); gathering re-allocates *the same storage* and re-points the views. Autograd's saved tensors
  that are views of ``full`` (e.g. ``W.t()`` saved by a matmul) therefore see the re-gathered values in
  backward.

Nothing here communicates except ``gather`` (collective over the axis).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from ... import comm
from ...comm.ops import shard_offsets, shard_sizes
from ...mesh import Mesh
from ..common.materialize import ModuleResetSource, read_flat, swap_in
from .offload import to_host

__all__ = ["FlatLayout", "flat_layout", "FlatGroup"]


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter and each rank's shard sit in one flat buffer (plain data)."""

    numels: tuple[int, ...]
    """Elements of each parameter, in flat order."""
    offsets: tuple[int, ...]
    """Start of each parameter in the flat buffer."""
    total: int
    """``L``: elements of the flat buffer."""
    shard_sizes: tuple[int, ...]
    """Elements owned by each rank (``shard_sizes(L, N)``)."""
    shard_offsets: tuple[int, ...]
    """Start of each rank's shard, plus ``L`` at the end."""

    def shard(self, rank: int) -> tuple[int, int]:
        """``(lo, hi)``: the flat range owned by ``rank``."""
        return self.shard_offsets[rank], self.shard_offsets[rank + 1]

    def pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """``(param index, start inside the param, stop inside the param)`` for every parameter that
        overlaps ``rank``'s shard, in flat order (a parameter may be split across ranks)."""
        lo, hi = self.shard(rank)
        out = []
        for k, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(lo, off), min(hi, off + n)
            if a < b:
                out.append((k, a - off, b - off))
        return out


def flat_layout(numels: Sequence[int], parts: int) -> FlatLayout:
    """Lay parameters of ``numels`` elements end to end and cut the result into ``parts`` shards."""
    if parts < 1:
        raise ValueError(f"need at least 1 shard, got {parts}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {list(numels)}")
    offsets, pos = [], 0
    for n in numels:
        offsets.append(pos)
        pos += n
    return FlatLayout(numels=tuple(numels), offsets=tuple(offsets), total=pos,
                      shard_sizes=tuple(shard_sizes(pos, parts)), shard_offsets=tuple(shard_offsets(pos, parts)))


class FlatGroup:
    """Parameters of one bucket (stages 1-2) or unit (stage 3) and their flat buffers on this rank.

    ``full``: the flat buffer in the compute dtype (``L`` elements while gathered). ``master``: this rank's
    shard as an ``nn.Parameter`` in the original dtype (what the optimizer updates); with no mixed
    precision and stages 1-2 it *aliases* ``full[lo:hi]`` (no extra memory). ``shard``: the compute-dtype
    shard that is all-gathered into ``full`` — ``full[lo:hi]`` itself in stages 1-2, a persistent buffer in
    stage 3 (aliasing ``master`` without mixed precision). After a step, ``shard`` is refreshed from
    ``master`` when they differ in dtype. ``algorithm``: the all-gather implementation (``comm.all_gather``).
    """

    def __init__(self, names: list[str], params: list[nn.Parameter], mesh: Mesh, axis: str, *,
                 compute_dtype: torch.dtype, sharded_params: bool, algorithm: str = "native",
                 offload: str | None = None) -> None:
        assert params, "a flat group holds at least one parameter"
        self.names, self.params = names, params
        self.mesh, self.axis, self.algorithm = mesh, axis, algorithm
        self.shapes = [p.shape for p in params]
        self.layout = flat_layout([p.numel() for p in params], mesh.size(axis))
        self.lo, self.hi = self.layout.shard(mesh.coord(axis))
        self.compute_dtype = compute_dtype
        self.sharded_params = sharded_params
        self.offload = offload  # "optimizer" / "params": master (and shard) in host memory (offload.py)
        device, master_dtype = mesh.device, params[0].dtype
        if sharded_params:
            self._init_sharded(device, master_dtype)
            return
        with torch.no_grad():
            exact = torch.cat([p.detach().reshape(-1) for p in params])
            exact = exact.to(device=device, dtype=master_dtype)
            self.full = exact.to(compute_dtype, copy=True)
            same = compute_dtype == master_dtype
            if sharded_params:
                shard = self.full[self.lo:self.hi].clone()
                self.master = nn.Parameter(shard if same else exact[self.lo:self.hi].clone())
                self.shard = self.master.detach() if same else shard
            else:
                # Alias the full buffer where dtypes agree: the optimizer then updates the model in place (offloaded:
                # a host copy on an accelerator; on a CPU mesh the same alias).
                master = self.full[self.lo:self.hi] if same else exact[self.lo:self.hi].clone()
                self.master = nn.Parameter(to_host(master, device) if offload else master)
                self.shard = self.full[self.lo:self.hi]
        self.gathered = True
        self._point_params()

    @torch.no_grad()
    def _init_sharded(self, device: torch.device, master_dtype: torch.dtype) -> None:
        """Stage 3: build only this rank's shard ``[lo, hi)``, piece by piece (a meta parameter's piece is read
        from its source: nothing else of it is ever allocated), and start freed."""
        pieces = [read_flat(self.params[k], a, b, device, self.names[k])
                  for k, a, b in self.layout.pieces(self.mesh.coord(self.axis))]
        exact = torch.cat([x.to(device=device, dtype=master_dtype) for x in pieces]) if pieces else \
            torch.empty(0, dtype=master_dtype, device=device)
        same = self.compute_dtype == master_dtype
        # (L,) of uninitialised memory, released at once: pages never touched, so no resident bytes (CPU)
        self.full = torch.empty(self.layout.total, dtype=self.compute_dtype, device=device)
        self.master = nn.Parameter(to_host(exact, device) if self.offload else exact)  # (hi - lo,) fresh (cat)
        if self.offload == "params" or not self.offload:  # the compute shard lives with the master
            self.shard = self.master.detach() if same else to_host(exact.to(self.compute_dtype), device) \
                if self.offload else exact.to(self.compute_dtype)
        else:  # offloaded optimizer: the compute shard stays on the device
            self.shard = exact if same else exact.to(self.compute_dtype)
        for i, p in enumerate(self.params):
            if p.is_meta:  # a real (empty) tensor in its place, the same object: ``.data`` can point at ``full``
                swap_in(p, nn.Parameter(torch.empty(0, dtype=self.compute_dtype, device=device),
                                        requires_grad=p.requires_grad))
        self.gathered = True
        self.free()
        ModuleResetSource.release()

    # -- views ----------------------------------------------------------------------------------------
    def _point_params(self) -> None:
        for p, off, n, shape in zip(self.params, self.layout.offsets, self.layout.numels, self.shapes):
            p.data = self.full[off:off + n].view(shape)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views of any ``L``-element flat tensor."""
        return [flat[off:off + n].view(shape)
                for off, n, shape in zip(self.layout.offsets, self.layout.numels, self.shapes)]

    # -- stage 3: gather / free -------------------------------------------------------------------------
    def start_gather(self) -> comm.Handle:
        """Start the all-gather of every rank's ``shard`` into ``full`` itself (collective; finish with
        ``finish_gather``): no buffer of its own per gather and no copy back. Stage 3 re-allocates ``full``'s
        storage here (freed since its last use; nothing reads it before ``finish_gather``); in stages 1-2
        ``shard`` is ``full``'s own slice, so this rank's part is not even copied."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.layout.total * self.full.element_size())
        src = self.shard.to(self.full.device, non_blocking=True)  # offloaded parameters: to the device first
        handle = comm.all_gather(src, self.mesh, self.axis, sizes=list(self.layout.shard_sizes),
                                 algorithm=self.algorithm, async_op=True, out=self.full)
        assert isinstance(handle, comm.Handle)
        return handle

    @torch.no_grad()
    def finish_gather(self, handle: comm.Handle) -> None:
        """Wait for the gather (it wrote ``full``) and re-point the params at it."""
        handle.wait()
        self.gathered = True
        self._point_params()

    def free(self) -> None:
        """Release the full buffer (storage resized to 0 bytes; params become empty tensors). Local."""
        empty = torch.empty(0, dtype=self.compute_dtype, device=self.full.device)
        for p in self.params:
            p.data = empty
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    # -- gradients ------------------------------------------------------------------------------------
    def flat_grads(self, dtype: torch.dtype, release: bool = False) -> torch.Tensor:
        """A new ``L``-element flat tensor of the params' gradients (zeros where a param has none). ``release``:
        drop each ``param.grad`` once copied, so the group's gradients exist about once, not twice."""
        out = torch.empty(self.layout.total, dtype=dtype, device=self.full.device)  # every element written once
        for view, p in zip(self.views(out), self.params):
            view.copy_(p.grad) if p.grad is not None else view.zero_()
            if release:
                p.grad = None
        return out

    @torch.no_grad()
    def load_full(self, values: list[torch.Tensor]) -> None:
        """Set the group from full per-parameter values (local: every rank passes the same values)."""
        exact = torch.cat([v.detach().reshape(-1).to(device=self.master.device, dtype=self.master.dtype)
                           for v in values])
        self.master.copy_(exact[self.lo:self.hi])
        if self.sharded_params:
            self.shard.copy_(self.master)
        else:
            self.full.copy_(exact)
