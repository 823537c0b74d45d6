"""A pipeline step's batch -> this rank's micro-batches (pure).

Every rank passes the global batch; with a data-parallel axis each replica takes its contiguous slice (S(0)
over dp), then the slice is cut into ``m`` micro-batches along dim 0.

* chain pipelines: ``step(inputs, targets)``, two tensors;
* graph pipelines (``example_inputs``): ``step(*args, **kwargs)`` exactly as the model's forward takes them
  (``input_ids=..., labels=...``), plus the targets as the last positional argument when a ``loss_fn`` is
  given. Every tensor whose dim 0 is the batch size is split; other values go to every micro-batch as they are.
  The micro-batches must have the shapes the graph was captured with (``example_inputs`` is one micro-batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from .capture import Graph

__all__ = ["normalize_example", "split_chain", "split_graph"]

MicroBatch = tuple[tuple, dict]


def normalize_example(example: Any) -> MicroBatch:
    """``(args, kwargs)`` from a tensor, a tuple/list of positional arguments, or a dict of keyword arguments
    (keys sorted, so the flattened order never depends on how the call spelled them)."""
    if isinstance(example, Tensor):
        return (example,), {}
    if isinstance(example, dict):
        return (), dict(sorted(example.items()))
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    raise TypeError(f"example_inputs must be a tensor, a tuple of positional arguments or a dict of keyword "
                    f"arguments for the model's forward (one micro-batch), got {type(example).__name__}")


def _check_rows(label: str, t: Any, m: int, dp: int, dp_axis: str | None) -> None:
    if not isinstance(t, Tensor) or t.dim() == 0 or t.size(0) % (m * dp) != 0:
        shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"pipeline {label} must be a tensor whose batch dim 0 is divisible by microbatches="
                         f"{m}" + (f" x {dp_axis} size {dp}" if dp > 1 else "") + f", got {shape}; "
                         f"use a batch size that is a multiple of {m * dp}")


def split_chain(inputs: Tensor, targets: Tensor, m: int, dp: int, dp_coord: int, dp_axis: str | None,
                device: torch.device) -> tuple[list[Tensor], list[Tensor]]:
    for label, t in (("inputs", inputs), ("targets", targets)):
        _check_rows(label, t, m, dp, dp_axis)
    if inputs.size(0) != targets.size(0):
        raise ValueError(f"inputs and targets disagree on the batch size: {inputs.size(0)} vs {targets.size(0)}")
    if dp > 1:  # S(0) over dp: this replica's contiguous slice of the global batch
        inputs, targets = inputs.chunk(dp)[dp_coord], targets.chunk(dp)[dp_coord]
    return list(inputs.to(device).chunk(m)), list(targets.to(device).chunk(m))


def split_graph(args: tuple, kwargs: dict, with_targets: bool, graph: Graph, m: int, dp: int, dp_coord: int,
                dp_axis: str | None, device: torch.device) -> tuple[list[MicroBatch], list[Tensor | None]]:
    targets = None
    if with_targets:
        if not args:
            raise TypeError("with loss_fn, pipe.step takes the model's inputs and then the targets as the last "
                            "positional argument: pipe.step(x, targets) or pipe.step(targets, input_ids=...)")
        args, targets = args[:-1], args[-1]
    flat, spec = pytree.tree_flatten((tuple(args), dict(sorted(kwargs.items()))))
    if spec != graph.input_spec:
        raise ValueError(f"pipe.step got inputs shaped like {spec} but the graph was captured from example_inputs "
                         f"shaped like {graph.input_spec}; pass the same arguments (names and structure) as "
                         f"example_inputs")
    batched = [t for t in flat if isinstance(t, Tensor) and t.dim() > 0]
    if not batched:
        raise ValueError("pipe.step got no tensor inputs to split into micro-batches")
    rows = batched[0].size(0)
    _check_rows("inputs", batched[0], m, dp, dp_axis)
    pieces = [_pieces(x, rows, m, dp, dp_coord, device) for x in flat]
    mbs = [pytree.tree_unflatten([p[i] for p in pieces], spec) for i in range(m)]
    _check_shapes(graph, mbs[0], m, dp)
    if targets is not None:
        _check_rows("targets", targets, m, dp, dp_axis)
        tg = targets.chunk(dp)[dp_coord] if dp > 1 else targets
        return mbs, list(tg.to(device).chunk(m))
    return mbs, [None] * m


def _pieces(x: Any, rows: int, m: int, dp: int, dp_coord: int, device: torch.device) -> list[Any]:
    if not (isinstance(x, Tensor) and x.dim() > 0 and x.size(0) == rows):
        return [x.to(device) if isinstance(x, Tensor) else x] * m
    mine = x.chunk(dp)[dp_coord] if dp > 1 else x
    return list(mine.to(device).chunk(m))


def _check_shapes(graph: Graph, mb: MicroBatch, m: int, dp: int) -> None:
    flat = pytree.tree_flatten(mb)[0]
    for node in graph.nodes:
        if node.op != "input" or node.meta is None:
            continue
        got = flat[node.target]
        if tuple(got.shape) != node.meta[1]:
            raise ValueError(f"a micro-batch input has shape {tuple(got.shape)} but the graph was captured with "
                             f"{node.meta[1]}: the capture fixes shapes, so example_inputs must be one micro-batch "
                             f"(batch / (microbatches {m} x dp {dp}) rows, same sequence length)")
