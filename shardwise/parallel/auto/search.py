"""One layout search of ``sw.auto``: a fixed tp axis (or none), pins and tied weights applied, solved exactly.

Tied weights (an embedding shared with the LM head) and modules called more than once must take one layout
kind across their uses: their groups' joint kinds are enumerated (up to ``MAX_TIE_COMBOS`` combinations;
beyond that the groups are kept replicated and the result is marked not exact).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch.nn as nn

from .cost import CostModel
from .options import NodeOptions, Option, node_options
from .pins import Pin
from .solve import NoFit, Solution, solve
from .trace import Graph

__all__ = ["Search", "search", "tie_groups", "check_pins", "PinError", "MAX_TIE_COMBOS"]

MAX_TIE_COMBOS = 64


@dataclass
class Search:
    cm: CostModel
    options: list[NodeOptions]
    solution: Solution
    chosen: list[Option]


def tie_groups(graph: Graph) -> list[list[int]]:
    """Node indices that must share a layout kind: the same module called twice, or modules sharing a parameter."""
    owner: dict[int, str] = {}
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            x = parent[x]
        return x
    for name, params in graph.params.items():
        for _, p in params:
            if id(p) in owner:
                parent[find(name)] = find(owner[id(p)])
            owner.setdefault(id(p), name)
    groups: dict[str, list[int]] = {}
    for n in graph.units():
        groups.setdefault(find(n.name), []).append(n.index)
    return [g for g in groups.values() if len(g) > 1]


def _filtered(opts: list[NodeOptions], forced: dict[int, str], pins: dict[int, Pin]) -> list[list[Option]]:
    out = []
    for i, no in enumerate(opts):
        keep = [o for o in no.options if forced.get(i, o.kind) == o.kind
                and (i not in pins or pins[i].kind == o.kind)]
        if i in pins and pins[i].style is not None:
            keep = [Option(o.kind, pins[i].style, o.need, o.gives, o.time_s, o.memory, o.parts) for o in keep]
        out.append(keep)
    return out


class PinError(ValueError):
    """A pin cannot hold on this tp axis (the message says why)."""


def check_pins(graph: Graph, opts: list[NodeOptions], pins: dict[int, Pin], cm: CostModel) -> str | None:
    """Why ``pins`` cannot hold with tp on ``cm.tp`` (None: they can)."""
    for i, pin in sorted(pins.items()):
        if pin.kind == "B":
            continue
        if cm.tp is None or (pin.axis is not None and pin.axis != cm.tp):
            return f"pin {pin.pattern!r}: {pin.kind} splits over {pin.axis or 'a tp axis'}"
        if pin.kind not in {o.kind for o in opts[i].options}:
            why = opts[i].unavailable.get(pin.kind, "not applicable")
            return (f"pins[{pin.pattern!r}] = {pin.kind!r} cannot apply to {graph.nodes[i].name} over "
                    f"{cm.tp}={cm.t}: {why}")
    return None


def search(graph: Graph, parents: dict[str, nn.Module], cm: CostModel, pins: dict[int, Pin],
           budget: float | None, forced: dict[int, str] | None = None, max_states: int = 20000) -> Search:
    """The best layout with tp on ``cm.tp``. ``NoFit`` over budget; ``ValueError`` when infeasible."""
    opts = [node_options(graph, n, parents, cm) for n in graph.nodes]
    why = check_pins(graph, opts, pins, cm)
    if why is not None:
        raise PinError(why)
    groups = tie_groups(graph)
    for g in groups:
        pinned = {graph.nodes[i].name: pins[i].kind for i in g if i in pins}
        if len(set(pinned.values())) > 1:
            raise PinError(f"pins give modules that share parameters (tied weights or one module called twice) "
                           f"different layouts {pinned}; pin them alike")
    per_group = [sorted(set.intersection(*({o.kind for o in opts[i].options} for i in g))) for g in groups]
    combos: Sequence[tuple[str, ...]] = list(itertools.product(*per_group))
    exact = len(combos) <= MAX_TIE_COMBOS
    if not exact:
        combos = [tuple("B" for _ in groups)]
    best: tuple[Solution, list[list[Option]]] | None = None
    nofit: NoFit | None = None
    for combo in combos:
        force = dict(forced or {})
        if any(force.setdefault(i, kind) != kind for g, kind in zip(groups, combo) for i in g):
            continue
        filtered = _filtered(opts, force, pins)
        try:
            sol = solve(filtered, [n.preds for n in graph.nodes], budget, max_states)
        except NoFit as exc:
            nofit = exc if nofit is None or exc.min_memory < nofit.min_memory else nofit
            continue
        except ValueError:
            continue
        if best is None or (sol.time_s, sol.memory) < (best[0].time_s, best[0].memory):
            best = (sol, filtered)
    if best is None:
        if nofit is not None:
            raise nofit
        shown = sorted({f"{p.pattern}={p.kind}" for p in pins.values()})
        raise ValueError(f"no feasible layout with the pins {shown} over {cm.tp}: a column layer's output must "
                         f"reach a row layer (or the model output, for vocab) through per-feature ops, and each "
                         f"row layer's input must come from column layers; pin the partner layers too, or use 'B'")
    sol, filtered = best
    sol = Solution(sol.choice, sol.time_s, sol.memory, sol.exact and exact)
    return Search(cm, opts, sol, [filtered[i][j] for i, j in enumerate(sol.choice)])
