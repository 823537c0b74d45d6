"""``sw.auto`` and context parallelism (pure, no processes): the plan's ``"": ContextParallel(axis)`` entry on a
mesh with a cp axis, the axes searched around it, the printed reason, and every refusal (an attn_mask, dropout,
a sequence that does not divide into 2·cp chunks, no attention call) with the axis then searched like any
other."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise as sw
from shardwise.mesh import MeshLayout
from shardwise.parallel.auto.context import decide_context
from shardwise.parallel.auto.trace import trace_graph


def _gpt(dropout: float = 0.0) -> nn.Module:
    torch.manual_seed(0)
    return sw.models.GPT(dataclasses.replace(sw.models.GPTConfig.preset("gpt-tiny"), dropout=dropout))


def _ids(S: int = 32) -> torch.Tensor:
    return torch.randint(0, 100, (2, S), generator=torch.Generator().manual_seed(0))


def _mesh(**axes: int) -> MeshLayout:
    return MeshLayout(tuple(axes), tuple(axes.values()))


class Attn(nn.Module):
    """q, k, v projections and one SDPA call, optionally with a mask."""

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.qkv, self.out, self.masked = nn.Linear(16, 48), nn.Linear(16, 16), masked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, 2, 8).transpose(1, 2) for t in self.qkv(x).split(16, dim=-1))
        mask = torch.ones(s, s, dtype=torch.bool).tril() if self.masked else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not self.masked)
        return self.out(y.transpose(1, 2).reshape(b, s, 16))


def test_the_plan_carries_context_parallel_over_cp():
    plan = sw.auto(_gpt(), _mesh(cp=2), example_inputs=(_ids(),))
    assert plan[""] == sw.ContextParallel(axis="cp") and plan.cp_axis == "cp"
    assert plan.tp_axis is None and plan.dp_axes == ()
    assert "context parallel over 'cp' (2): attention ring, sequence split 2·cp = 4 ways" in str(plan)
    assert all("cp" not in label for label, _, _ in plan.layouts)  # the cp axis is neither data nor tp
    back = sw.ParallelizePlan.from_text(str(plan))
    assert dict(back.styles) == dict(plan.styles) and back.cp_axis == "cp"
    assert sw.ParallelizePlan.from_json(plan.to_json()).styles == plan.styles
    assert plan.edit({"": "B"}).cp_axis is None


def test_the_other_axes_are_searched_around_cp():
    plan = sw.auto(_gpt(), _mesh(dp=2, cp=2, tp=2), example_inputs=(_ids(),))
    assert plan.cp_axis == "cp" and "cp" not in plan.dp_axes and plan.tp_axis != "cp"
    assert set(plan.dp_axes) | {plan.tp_axis} - {None} == {"dp", "tp"}


def test_a_user_named_axis_and_opting_out():
    plan = sw.auto(_gpt(), _mesh(dp=2, seq=2), example_inputs=(_ids(),), cp_axis="seq")
    assert plan[""] == sw.ContextParallel(axis="seq") and plan.dp_axes == ("dp",)
    plain = sw.auto(_gpt(), _mesh(cp=2), example_inputs=(_ids(),), cp_axis=None)
    assert plain.cp_axis is None and "" not in plain and plain.context == "" and plain.dp_axes == ("cp",)
    with pytest.raises(ValueError, match="cp_axis='nope' is not an axis of the mesh"):
        sw.auto(_gpt(), _mesh(cp=2), example_inputs=(_ids(),), cp_axis="nope")
    # a mesh without a cp axis, or with cp = 1: nothing said, nothing changed
    for mesh in (_mesh(dp=2), _mesh(dp=2, cp=1)):
        plan = sw.auto(_gpt(), mesh, example_inputs=(_ids(),))
        assert plan.cp_axis is None and plan.context == "" and "context parallel" not in str(plan)


@pytest.mark.parametrize("case, why", [
    ("mask", "get an attn_mask tensor"),
    ("dropout", "attention dropout > 0 in training (blocks.0.attn.dropout = 0.1)"),
    ("seq", "sequence length 30 is not divisible by 2·cp = 4"),
    ("none", "calls no scaled_dot_product_attention"),
])
def test_refusals_say_why_and_search_the_axis(case, why):
    model, x = {"mask": (Attn(masked=True), torch.randn(2, 8, 16)),
                "dropout": (_gpt(0.1), _ids()),
                "seq": (_gpt(), _ids(30)),
                "none": (nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(4, 16))}[case]
    plan = sw.auto(model, _mesh(cp=2), example_inputs=(x,))
    assert plan.cp_axis is None and "" not in plan
    assert why in plan.context and plan.context.startswith("context parallel over 'cp' (2): refused")
    assert plan.context in str(plan)
    assert plan.dp_axes == ("cp",) or plan.tp_axis == "cp"  # searched like any other axis


def test_the_tracer_records_every_attention_call():
    g = trace_graph(_gpt().eval(), (_ids(),))
    assert len(g.attention) == 2  # gpt-tiny's two blocks
    assert all(a.seq == 32 and a.is_causal and not a.mask and a.dropout_p == 0 for a in g.attention)
    masked = trace_graph(Attn(masked=True), (torch.randn(2, 8, 16),))
    assert [a.mask for a in masked.attention] == [True]
    assert decide_context(masked, Attn(), ("cp",), (2,), "cp").axis is None


def test_a_cp_pin_on_the_cp_axis_is_refused():
    with pytest.raises(ValueError, match="the context-parallel axis"):
        sw.auto(_gpt(), _mesh(cp=2, tp=2), example_inputs=(_ids(),), pins={"lm_head": {"cp": "vocab"}})


# -- sw.parallelize of a ContextParallel entry (a one-process world) -------------------------------------------------
@pytest.fixture(scope="module")
def one() -> object:
    import torch.distributed as dist

    created = not dist.is_initialized()
    sw.init(backend="gloo")
    yield sw.Mesh(dp=1, cp=1)
    if created:
        dist.destroy_process_group()


def test_parallelize_applies_context_parallel_last(one):
    model, ids = _gpt().eval(), _ids()
    want = model(ids)
    got = sw.parallelize(model, one, {"": sw.ContextParallel()})
    assert got is model and getattr(model, "_shardwise_context_parallel", None) is not None
    torch.testing.assert_close(model(ids), want, rtol=1e-5, atol=1e-6)  # cp = 1: the ring is one block


@pytest.mark.parametrize("plan, kw, match", [
    ({"blocks.0": sw.ContextParallel()}, {}, "key it by the root module ''"),
    ({"": sw.ContextParallel(axis="seq")}, {}, "not an axis of the mesh"),
    ({"": sw.ContextParallel()}, {"axis": "cp"}, "both 'cp'"),
])
def test_parallelize_refuses_a_bad_context_entry_before_changing_anything(one, plan, kw, match):
    model = _gpt()
    with pytest.raises(ValueError, match=match):
        sw.parallelize(model, one, plan, **kw)
    assert getattr(model, "_shardwise_context_parallel", None) is None
    sw.parallelize(model, one, {"": sw.ContextParallel()})
    with pytest.raises(ValueError, match="already applied"):
        sw.parallelize(model, one, {"": sw.ContextParallel()})
