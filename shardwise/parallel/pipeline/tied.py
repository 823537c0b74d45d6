"""Parameters a pipeline rank shares with one other rank (a tied embedding and head): who holds them, and the
exchange that sums their gradient contributions after each step's backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ... import comm
from ...mesh import Mesh

__all__ = ["tied_parameters", "sum_tied_grads"]


def tied_parameters(stages: list[Any], p: int, me: int) -> list[tuple[nn.Parameter, int]]:
    """(parameter, peer rank) for each parameter this rank shares with one other rank's stages (pure).

    Every rank lists them in the same order (stage order, then parameter order), so the exchanges pair up.
    """
    users: dict[int, tuple[nn.Parameter, list[int]]] = {}
    for s in stages:
        for param in s.parameters():
            ranks = users.setdefault(id(param), (param, []))[1]
            if s.index % p not in ranks:
                ranks.append(s.index % p)
    out = []
    for param, ranks in users.values():
        if len(ranks) > 2:
            raise ValueError(f"a parameter of shape {tuple(param.shape)} is used by stages on pipeline ranks "
                             f"{ranks}; tied parameters may span at most two ranks (e.g. embedding and head)")
        if len(ranks) == 2 and me in ranks:
            out.append((param, ranks[0] if ranks[1] == me else ranks[1]))
    return out


def sum_tied_grads(mesh: Mesh, axis: str, tied: list[tuple[nn.Parameter, int]],
                   before: dict[int, Tensor | None]) -> None:
    """Exchange this step's gradient contribution of each tied parameter with its peer rank and add it
    (point-to-point along the axis, one message each way per parameter)."""
    for param, peer in tied:
        if not param.requires_grad:  # a frozen tie (a pretrained embedding): no gradient on either rank, both skip
            continue
        old = before[id(param)]
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        mine = grad - old if old is not None else grad.clone()  # only this step's part (accumulation-safe)
        theirs = torch.empty_like(mine)
        # the lower coordinate sends first, the higher receives first: transports that run a pair's
        # send and receive in one ordered stream (NCCL) then never wait on each other's receive
        if mesh.coord(axis) < peer:
            handles = [comm.isend(mine, mesh, axis, dst=peer),
                       comm.irecv(theirs, mesh, axis, src=peer)]
        else:
            handles = [comm.irecv(theirs, mesh, axis, src=peer),
                       comm.isend(mine, mesh, axis, dst=peer)]
        for h in handles:
            h.wait()
        # Both ranks now hold the same bits of both contributions; summing them in pipeline-coordinate
        # order onto the (identical) earlier gradient keeps the two copies bit-identical. Adding `theirs`
        # onto `old + mine` would not: (old + g) - old is not g exactly once gradients accumulate.
        low, high = (mine, theirs) if mesh.coord(axis) < peer else (theirs, mine)
        total = low + high if old is None else old + (low + high)
        if param.grad is None:
            param.grad = total
        else:
            param.grad.copy_(total)  # in place: with dp, .grad is a view of a gradient bucket
