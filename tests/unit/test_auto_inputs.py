"""``sw.auto`` never offers a split a module cannot run: a layer that reads the model's own input (whole on every
rank: no column-parallel layer splits it first) is never offered ``RowParallel`` — not chosen, not priced as an
alternative, refused as a pin — while a row layer fed by a column layer still is."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise.mesh import MeshLayout
from shardwise.parallel.auto.cost import CostModel, NominalHardware
from shardwise.parallel.auto.options import node_options
from shardwise.parallel.auto.trace import trace_graph
from tests.dist.auto_models import WideInput

TP2 = MeshLayout(("tp",), (2,))


def _x() -> tuple[torch.Tensor]:
    return (torch.randn(8, 64, 4096, generator=torch.Generator().manual_seed(0)),)


def test_a_layer_reading_the_raw_input_is_never_offered_row():
    torch.manual_seed(0)
    model = WideInput()
    graph = trace_graph(model, _x())
    first = next(n for n in graph.units() if n.name == "inp")
    assert first.preds == ()  # fed by no traced node: the model's input
    plan = sw.auto(model, TP2, _x())
    styles = {name: type(style).__name__ for name, style in plan.items()}
    assert styles.get("inp") != "RowParallel", plan
    row = next(r for r in plan.rows if r.pattern == "inp")
    offered = {kind: t for kind, t, _ in row.alternatives}
    assert offered.get("row") is None, row  # not priced: not an alternative at all
    down = next(r for r in plan.rows if r.pattern == "down")
    assert any(kind == "row" and t is not None for kind, t, _ in down.alternatives) or styles.get("down") == \
        "RowParallel", down  # a row layer after a column one is still offered


def test_under_a_memory_budget_the_input_layer_is_split_by_column():
    """The budget excludes pure data parallelism; a row split of ``inp`` (which cannot run) would be the cheapest
    tensor-parallel plan in memory, and was chosen before this rule."""
    torch.manual_seed(0)
    plan = sw.auto(WideInput(), TP2, (torch.randn(2, 16, 4096),), memory_budget=0.8 * 2**20)
    styles = {name: type(style).__name__ for name, style in plan.items()}
    assert plan.tp_axis == "tp" and styles["inp"] == "ColumnParallel" and styles["up"] == "RowParallel", plan


def test_a_row_pin_on_the_raw_input_layer_is_refused_in_one_line():
    torch.manual_seed(0)
    with pytest.raises(ValueError) as err:
        sw.auto(WideInput(), TP2, _x(), pins={"inp": "row"})
    assert "\n" not in str(err.value) and "model's own input" in str(err.value)


def test_the_tensor_parallel_plan_uses_column_then_row():
    torch.manual_seed(0)
    plan = sw.auto(WideInput(), TP2, _x(), pins={"inp": "column"})
    styles = {name: type(style).__name__ for name, style in plan.items()}
    assert styles["inp"] == "ColumnParallel" and styles.get("up") == "RowParallel", plan


def test_node_options_of_the_input_layer_hold_no_option_needing_a_split_input():
    torch.manual_seed(0)
    graph = trace_graph(WideInput(), _x())
    cm = CostModel(NominalHardware(), ("tp",), (2,), "tp", 4, "fp32")
    by_name = {n.name: n for n in graph.units()}
    first = node_options(graph, by_name["inp"], {}, cm)
    assert {o.kind for o in first.options} == {"B", "column"} and "model's own input" in first.unavailable["row"]
    later = node_options(graph, by_name["up"], {}, cm)  # fed by inp: row stays an option
    assert "row" in {o.kind for o in later.options}
