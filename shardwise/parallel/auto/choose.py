"""``sw.auto``: choose every parameterised module's layout by cost, for ``sw.parallelize`` + ``sw.DataParallel``.

    plan = sw.auto(model, mesh, example_inputs=(input_ids,))     # or example_inputs={"input_ids": ids}
    print(plan)
    model = sw.parallelize(model, mesh, plan) if plan.tp_axis else model

Steps: trace the model once on ``example_inputs`` (``trace.py``: forward hooks plus a ``TorchFunctionMode``;
no ``torch.fx``) into a graph of units and joins; for each choice of tensor-parallel axis — none (pure data
parallelism over every axis) or one mesh axis of size > 1, the others carrying data — price every node's
layouts (``options.py``: compute, the conversions ``sw.parallelize`` performs priced by the boxing router,
gradient all-reduce over the data axes, memory) and solve the graph exactly (``solve.py``); keep the cheapest.
Weights are split over at most one axis (``sw.parallelize`` shards over one); the 1-axis hybrid where the
same axis carries data for some layers and a weight split for others is not searched (no executor for it).

``example_inputs`` is one step's *global* batch, as for one device: data axes divide its batch dim (dim 0).
Context parallelism (``context.py``): on a mesh with a ``cp`` axis (``cp_axis=``) of size > 1 whose model's
attention can run as a ring, the plan gets ``"": ContextParallel(axis)`` and the other axes are searched as
above; the example inputs hold the *full* sequence (each rank later feeds ``shard_sequence`` of it).
Pure and deterministic: the same inputs give the same plan on every rank; it never communicates (the
traced forward runs locally under ``torch.no_grad`` in eval mode; call it on the plain model).
"""

from __future__ import annotations

import fnmatch
import re
from typing import Any, Mapping

import torch
import torch.nn as nn

from torch.utils._pytree import tree_map

from ...mesh import Mesh, MeshLayout
from ..common.materialize import has_meta
from ..tensor.styles import ContextParallel
from .context import decide_context
from .cost import CostModel, NominalHardware
from .options import applicable
from .pins import Pin, parse_pins
from .plan import ParallelizePlan, Row
from .search import PinError, Search, search
from .solve import NoFit
from .trace import Graph, trace_graph

__all__ = ["auto"]


def _layout(mesh: Mesh | MeshLayout) -> tuple[tuple[str, ...], tuple[int, ...], dict[int, Any]]:
    if isinstance(mesh, Mesh):
        return mesh.axes, mesh.shape, mesh.calibrations
    if isinstance(mesh, MeshLayout):
        return mesh.axes, mesh.shape, {}
    raise TypeError(f"mesh must be a shardwise.Mesh or MeshLayout, got {type(mesh).__name__}")


def _check(model: nn.Module, memory_budget: float | None) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"sw.auto plans an nn.Module, got {type(model).__name__}")
    if getattr(model, "_shardwise_tensor_parallel", None) is not None or hasattr(model, "_shardwise_data_parallel"):
        raise ValueError(f"{type(model).__name__} is already parallelized; call sw.auto on the plain model")
    if memory_budget is not None and not (isinstance(memory_budget, (int, float)) and memory_budget > 0):
        raise ValueError(f"memory_budget must be a positive number of bytes per rank, got {memory_budget!r}")


def _trace(model: nn.Module, example_inputs: Any) -> Graph:
    modes = {m: m.training for m in model.modules()}
    model.eval()  # no dropout, no running-statistics updates while tracing
    if has_meta(model):  # built on the meta device: trace shapes only, the inputs on meta too
        example_inputs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, example_inputs)
    try:
        return trace_graph(model, example_inputs)
    finally:
        for m, training in modes.items():
            m.train(training)


def _dtype(model: nn.Module) -> tuple[int, str]:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = torch.float32 if p is None else p.dtype
    return torch.empty((), dtype=dtype).element_size(), "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def _label(tp: str | None, axes: tuple[str, ...], shape: tuple[int, ...]) -> str:
    if tp is None:
        return f"data parallel over {[a for a, s in zip(axes, shape) if s > 1] or list(axes)}"
    return f"tp over {tp!r} ({shape[axes.index(tp)]})"


def _searches(graph: Graph, parents: dict[str, nn.Module], cms: list[CostModel], pins: dict[int, Pin],
              budget: float | None) -> tuple[dict[str | None, Search], list[tuple[str, float | None, str]]]:
    found: dict[str | None, Search] = {}
    layouts: list[tuple[str, float | None, str]] = []
    pin_errors: list[str] = []
    errors: list[str] = []
    smallest: float | None = None
    for cm in cms:
        label = _label(cm.tp, cm.axes, cm.shape)
        try:
            s = search(graph, parents, cm, pins, budget)
        except PinError as exc:
            pin_errors.append(str(exc))
            layouts.append((label, None, f"excluded: {exc}"))
            continue
        except NoFit as exc:
            smallest = exc.min_memory if smallest is None else min(smallest, exc.min_memory)
            layouts.append((label, None, f"over budget (smallest {exc.min_memory / 2**20:.2f} MiB)"))
            continue
        except ValueError as exc:
            errors.append(str(exc))
            layouts.append((label, None, "infeasible"))
            continue
        found[cm.tp] = s
        idle = cm.tp is not None and all(o.style is None for o in s.chosen)
        note = " (splits nothing: every rank of the axis computes the same)" if idle else ""
        layouts.append((label, s.solution.time_s, f"{s.solution.memory / 2**20:.2f} MiB{note}"))
    if not found and smallest is not None:
        raise ValueError(f"memory_budget={budget:.0f} bytes per rank is below the smallest predicted footprint of "
                         f"any layout, {smallest:.0f} bytes; raise the budget, add ranks, or use sw.zero")
    if not found and pin_errors and not errors:
        raise ValueError(pin_errors[-1] + "; change the pin or the mesh")
    if not found:
        raise ValueError(errors[-1])
    return found, layouts


def _pattern(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", name)


def _compress(by_name: dict[str, Any], all_names: list[str], unit_kind: dict[str, Any]) -> dict[str, Any]:
    """Module-name -> value, with layer indices replaced by ``*`` where every module the pattern matches
    (among ``all_names``) has the same value."""
    out: dict[str, Any] = {}
    for name, value in by_name.items():
        pattern = _pattern(name)
        hits = [n for n in all_names if fnmatch.fnmatchcase(n, pattern)]
        same = all(n in unit_kind and unit_kind[n] == value for n in hits)
        out[pattern if same else name] = value
    return out


def _forced(graph: Graph, parents: dict[str, nn.Module], found: dict[str | None, Search], members: list[int],
            kind: str, pins: dict[int, Pin], budget: float | None) -> tuple[float | None, str]:
    """The best step time over every axis choice with ``members`` forced to ``kind`` (None and why if none)."""
    best: float | None = None
    why = "no feasible plan around it"
    for s in found.values():
        missing = [i for i in members if kind not in {o.kind for o in s.options[i].options}]
        if missing:
            if s.cm.tp is not None:
                why = s.options[missing[0]].unavailable.get(kind, why)
            continue
        try:
            t = search(graph, parents, s.cm, {i: p for i, p in pins.items() if i not in members}, budget,
                       forced={i: kind for i in members}).solution.time_s
        except ValueError:
            continue
        best = t if best is None else min(best, t)
    return best, ("" if best is not None else why)


def _rows(graph: Graph, parents: dict[str, nn.Module], found: dict[str | None, Search], best: Search,
          pins: dict[int, Pin], budget: float | None) -> tuple[Row, ...]:
    """Per module group: the chosen kind, its own price, and every alternative's best whole-plan time."""
    groups: dict[str, list[int]] = {}
    for n in graph.units():
        groups.setdefault(_pattern(n.name), []).append(n.index)
    rows = []
    for pattern, members in groups.items():
        kinds = {best.chosen[i].kind for i in members}
        kind = kinds.pop() if len(kinds) == 1 else "mixed"
        alts = tuple((alt, *_forced(graph, parents, found, members, alt, pins, budget))
                     for alt in applicable(graph.nodes[members[0]]) if alt != kind)
        rows.append(Row(pattern, kind, sum(best.chosen[i].time_s for i in members), alts,
                        type(graph.nodes[members[0]].module).__name__, any(i in pins for i in members)))
    return tuple(rows)


def auto(model: nn.Module, mesh: Mesh | MeshLayout, example_inputs: Any, memory_budget: float | None = None,
         pins: Mapping[str, Any] | None = None, *, hardware: Any = None, cp_axis: str | None = "cp"
         ) -> ParallelizePlan:
    """The cheapest layout of ``model`` on ``mesh`` as a ``ParallelizePlan`` (see module docstring and ``plan.py``).

    ``example_inputs``: a tuple of positional args, a dict of keyword args, or one tensor — one global batch.
    ``memory_budget``: bytes per rank; layouts over it are rejected (``ValueError`` naming the smallest
    predicted footprint when all are). ``pins``: fixed layouts by module-name pattern (``pins.py``).
    ``hardware``: a ``sw.planner.Hardware`` (preset or ``Hardware.load(calibration)``); default: the mesh's
    attached collective calibrations plus nominal constants (``cost.NominalHardware``). ``cp_axis``: the mesh
    axis context parallelism may use (``context.py``; default ``"cp"`` where the mesh has it; None: never).
    Local: never communicates; the same on every rank."""
    _check(model, memory_budget)
    axes, shape, calibrations = _layout(mesh)
    graph = _trace(model, example_inputs)
    units = [n.name for n in graph.units()]
    by_unit = parse_pins(pins, units, axes)
    node_pins = {n.index: by_unit[n.name] for n in graph.units() if n.name in by_unit}
    modules = dict(model.named_modules())
    parents = {u: modules[u.rpartition(".")[0]] for u in units}
    itemsize, dtype = _dtype(model)
    hw = hardware if hardware is not None else NominalHardware(calibrations=calibrations)
    ctx = decide_context(graph, model, axes, shape, cp_axis)
    if ctx.axis is not None:  # the cp axis carries the sequence: neither batch nor weights are split over it
        for pin in by_unit.values():
            if pin.axis == ctx.axis:
                raise ValueError(f"pin {pin.pattern!r} splits over {ctx.axis!r}, the context-parallel axis; pin "
                                 f"another axis, or pass cp_axis=None")
        keep = [i for i, a in enumerate(axes) if a != ctx.axis]
        axes, shape = tuple(axes[i] for i in keep), tuple(shape[i] for i in keep)
    cms = [CostModel(hw, axes, shape, tp, itemsize, dtype) for tp in [None, *(a for a, s in zip(axes, shape) if s > 1)]]
    found, layouts = _searches(graph, parents, cms, node_pins, memory_budget)
    # ties: pure data parallelism first (simplest), then the innermost axis (fastest links by convention)
    rank = {tp: (-1 - len(axes) if tp is None else -axes.index(tp)) for tp in found}
    best = min(found.values(), key=lambda s: (s.solution.time_s, s.solution.memory, rank[s.cm.tp]))
    chosen = {graph.nodes[i].name: o for i, o in enumerate(best.chosen) if graph.nodes[i].kind == "module"}
    styles = {name: o.style for name, o in chosen.items() if o.style is not None}
    styles = _compress(styles, list(modules), {n: o.style for n, o in chosen.items()})
    vocab_out = any(o.kind == "vocab" and graph.nodes[i].sink and isinstance(graph.nodes[i].module, nn.Linear)
                    for i, o in enumerate(best.chosen))
    dp_axes = tuple(a for a in axes if a != best.cm.tp)
    if ctx.axis is not None:
        styles[""] = ContextParallel(axis=ctx.axis)  # applied last by sw.parallelize
    return ParallelizePlan(styles, best.cm.tp, dp_axes, vocab_out, best.solution.time_s, best.solution.memory,
                best.solution.exact, tuple(layouts), _rows(graph, parents, found, best, node_pins, memory_budget),
                context=ctx.note)
