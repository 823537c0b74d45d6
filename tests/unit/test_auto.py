"""``sw.auto`` planning without processes (a ``MeshLayout`` stands in for the mesh): the three expected
behaviours, the printed prices, ParallelizePlan round trips, pins, memory budget, determinism, tracing."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

import shardwise as sw
from shardwise.mesh import MeshLayout
from shardwise.parallel.auto.plan import ParallelizePlan
from shardwise.parallel.auto.trace import trace_graph
from tests.dist.auto_models import MEGATRON, Classifier, SmallMLP, TinyLlama, hf_llama

TP2 = MeshLayout(("tp",), (2,))


def _ids(b: int = 2, t: int = 16) -> tuple[torch.Tensor]:
    return (torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(0)),)


def _assert_megatron(plan: ParallelizePlan, model: nn.Module) -> None:
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    kinds = {}
    for name in names:
        hits = [s for p, s in plan.items() if __import__("fnmatch").fnmatchcase(name, p)]
        kinds[name] = type(hits[0]).__name__ if hits else "B"
    for name, kind in kinds.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in MEGATRON["column"]:
            assert kind == "ColumnParallel", (name, kind)
        elif leaf in MEGATRON["row"]:
            assert kind == "RowParallel", (name, kind)


def _assert_chosen_beats_alternatives(plan: ParallelizePlan) -> None:
    for row in plan.rows:
        for kind, t, _ in row.alternatives:
            if t is not None:
                assert plan.time_s < t, (row.pattern, row.kind, kind, plan.time_s, t)


@pytest.mark.parametrize("which", ["own", "hf"])
def test_llama_rediscovers_megatron(which):
    torch.manual_seed(0)
    model = TinyLlama() if which == "own" else hf_llama()
    if model is None:
        pytest.skip("transformers is not installed")
    plan = sw.auto(model, TP2, _ids())
    assert plan.tp_axis == "tp" and plan.dp_axes == ()
    _assert_megatron(plan, model)
    heads = {p.rsplit(".", 1)[-1]: s for p, s in plan.items()}
    assert heads["q_proj"] == sw.ColumnParallel(heads=8) and heads["k_proj"] == sw.ColumnParallel(heads=4)
    rows = {r.pattern.rsplit(".", 1)[-1]: r for r in plan.rows}
    for leaf in ("q_proj", "o_proj", "gate_proj", "down_proj"):  # the rejected alternatives have prices
        assert any(t is not None for _, t, _ in rows[leaf].alternatives), rows[leaf]
    _assert_chosen_beats_alternatives(plan)
    layouts = dict((label, t) for label, t, _ in plan.layouts)
    assert layouts["tp over 'tp' (2)"] < layouts["data parallel over ['tp']"]
    text = str(plan)
    assert "ColumnParallel(heads=8)" in text and "rejected" not in text and "B: " in text


def test_classifier_with_huge_head_splits_the_head_only():
    torch.manual_seed(0)
    plan = sw.auto(Classifier(), MeshLayout(("dp", "tp"), (2, 2)), (torch.randn(8, 16),))
    assert dict(plan) == {"head": sw.VocabParallel()}
    assert plan.tp_axis == "tp" and plan.dp_axes == ("dp",) and plan.vocab_parallel_loss
    _assert_chosen_beats_alternatives(plan)


def test_small_model_stays_data_parallel():
    plan = sw.auto(SmallMLP(), MeshLayout(("dp",), (2,)), torch.randn(64, 32))
    assert plan.tp_axis is None and plan.dp_axes == ("dp",) and dict(plan) == {}
    tp = [t for label, t, _ in plan.layouts if label.startswith("tp")]
    assert tp and tp[0] > plan.time_s  # the tensor-parallel alternative was priced, and higher


def test_plan_round_trips_and_edits():
    torch.manual_seed(0)
    plan = sw.auto(TinyLlama(), TP2, _ids())
    back = ParallelizePlan.from_text(str(plan))
    assert dict(back) == dict(plan) and (back.tp_axis, back.dp_axes) == (plan.tp_axis, plan.dp_axes)
    again = ParallelizePlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert dict(again) == dict(plan) and again.time_s == plan.time_s
    edited = plan.edit({"lm_head": sw.VocabParallel(), "layers.*.mlp.down_proj": "B"})
    assert edited["lm_head"] == sw.VocabParallel() and "layers.*.mlp.down_proj" not in edited
    assert edited.time_s is None  # the prices belonged to the planner's choice
    by_hand = str(plan).replace("  layers.*.mlp.down_proj -> RowParallel()\n", "")  # edited as text
    assert dict(ParallelizePlan.from_text(by_hand)) == {k: v for k, v in plan.items() if k != "layers.*.mlp.down_proj"}


def test_pins_fix_a_choice_and_the_rest_adapts():
    torch.manual_seed(0)
    model = TinyLlama()
    free = sw.auto(model, TP2, _ids())
    pinned = sw.auto(model, TP2, _ids(), pins={"layers.0.mlp.down_proj": "B"})
    assert "layers.0.mlp.down_proj" not in pinned and "layers.0.mlp.gate_proj" not in pinned  # its pair adapts
    assert pinned["layers.1.mlp.down_proj"] == sw.RowParallel()
    assert pinned.time_s > free.time_s
    vocab = sw.auto(model, TP2, _ids(), pins={"lm_head": {"tp": "vocab"}})
    assert vocab["lm_head"] == sw.VocabParallel() and vocab.vocab_parallel_loss


@pytest.mark.parametrize("pins, match", [
    ({"nothing.here": "B"}, "matches no planned module"),
    ({"lm_head": "diagonal"}, "use one of"),
    ({"lm_head": {"pp": "vocab"}}, "names mesh axis 'pp'"),
    ({"layers.0.mlp.gate_proj": "row"}, "no feasible layout"),
    ({"norm": "column"}, "cannot apply to norm"),
])
def test_bad_pins_are_one_line_errors(pins, match):
    with pytest.raises(ValueError, match=match) as info:
        sw.auto(TinyLlama(), TP2, _ids(), pins=pins)
    assert "\n" not in str(info.value)


def test_pin_contradicting_the_mesh():
    # 512 query features do not divide over tp=3; gate/up (1026) do
    layout = MeshLayout(("tp",), (3,))
    with pytest.raises(ValueError, match="out_features=512 is not divisible by tp=3") as info:
        sw.auto(TinyLlama(inter=1026), layout, _ids(), pins={"layers.*.self_attn.q_proj": "column"})
    assert "\n" not in str(info.value)
    plan = sw.auto(TinyLlama(inter=1026), layout, _ids())
    assert not any(p.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) for p in plan)  # attention stays B


def test_memory_budget():
    torch.manual_seed(0)
    model = TinyLlama()
    free = sw.auto(model, TP2, _ids())
    tight = sw.auto(model, TP2, _ids(), memory_budget=free.memory * 0.999)
    assert tight.memory <= free.memory * 0.999 and tight.time_s >= free.time_s
    with pytest.raises(ValueError, match="smallest predicted footprint") as info:
        sw.auto(model, TP2, _ids(), memory_budget=1e6)
    assert "\n" not in str(info.value)
    smallest = float(str(info.value).split("footprint of any layout, ")[1].split(" bytes")[0])
    assert smallest > 1e6
    assert sw.auto(model, TP2, _ids(), memory_budget=smallest + 1).memory <= smallest + 1


def test_deterministic_and_local():
    torch.manual_seed(0)
    model = TinyLlama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a, b = sw.auto(model, TP2, _ids()), sw.auto(model, TP2, _ids())
    assert str(a) == str(b)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # tracing changed nothing
    assert model.training  # mode restored


def test_trace_joins_residuals_and_branches():
    g = trace_graph(TinyLlama(n_layers=1), _ids())
    names = [n.name for n in g.nodes]
    q, o = names.index("layers.0.self_attn.q_proj"), names.index("layers.0.self_attn.o_proj")
    attn = g.nodes[o].preds[0]
    assert g.nodes[attn].kind == "join" and set(g.nodes[attn].preds) >= {q, q + 1, q + 2}  # q, k, v meet
    residual = [n for n in g.nodes if n.kind == "join" and o in n.preds][0]
    assert names.index("embed_tokens") in residual.preds  # x + attn(x)
    assert g.nodes[-1].name == "lm_head" and g.nodes[-1].sink


def test_bad_input():
    with pytest.raises(TypeError, match="example_inputs"):
        sw.auto(SmallMLP(), TP2, "not a tensor")
    with pytest.raises(ValueError, match="memory_budget"):
        sw.auto(SmallMLP(), TP2, torch.randn(4, 32), memory_budget=-1)
    with pytest.raises(TypeError, match="mesh"):
        sw.auto(SmallMLP(), {"tp": 2}, torch.randn(4, 32))


def test_keyword_example_inputs():
    torch.manual_seed(0)
    model = hf_llama(layers=1)
    if model is None:
        pytest.skip("transformers is not installed")
    by_kw = sw.auto(model, TP2, {"input_ids": _ids()[0]})
    assert dict(by_kw) == dict(sw.auto(model, TP2, _ids()))


@pytest.mark.parametrize("argv, match", [(["--embd", "100", "--heads", "8"], "multiple of --heads"),
                                         (["--batch", "3"], "multiple of -n 2"), (["--steps", "0"], "--steps")])
def test_bench_auto_rejects_bad_flags(argv, match, capsys):
    import argparse

    from shardwise.bench import auto as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.main(parser.parse_args(argv)) == 2  # before any rank starts
    assert match in capsys.readouterr().err


def _calibrated(alpha_us: float, beta_us_per_byte: float):  # type: ignore[no-untyped-def]
    from shardwise.comm.calibration import AlphaBeta, Calibration
    from shardwise.parallel.auto.cost import NominalHardware

    model = AlphaBeta(alpha_us, beta_us_per_byte)
    cal = Calibration(world_size=2, backend="gloo", device="cpu",
                      models={op: {"native": model} for op in ("all_reduce", "all_gather", "reduce_scatter")})
    return NominalHardware(calibrations={2: cal})


def test_calibrated_collectives_decide():
    """The same model flips between tensor and data parallelism with the measured alpha-beta of the link: a
    call that costs 2 ms (latency-bound link) makes the 14 per-step all-reduces of tp lose to data
    parallelism's one bucket; a latency-free, slow link (1 GB/s) makes moving every weight gradient lose to tp."""
    torch.manual_seed(0)
    model = TinyLlama()
    latency = sw.auto(model, TP2, _ids(), hardware=_calibrated(2e3, 1e-6))
    assert latency.tp_axis is None
    bandwidth = sw.auto(model, TP2, _ids(), hardware=_calibrated(0.0, 1e-3))
    assert bandwidth.tp_axis == "tp"
    _assert_megatron(bandwidth, model)


def test_planner_hardware_preset_is_accepted():
    torch.manual_seed(0)
    plan = sw.auto(TinyLlama(), TP2, _ids(), hardware=sw.planner.Hardware.preset("a100-80g-sxm"))
    assert plan.time_s is not None and plan.time_s > 0


def test_reference_gpt_gets_its_hand_written_plan():
    """The project's GPT carries a hand-written Megatron plan (fused qkv by whole heads, tied vocabulary-parallel
    embedding and head); sw.auto finds the same one, and a pin that breaks the tie is refused."""
    from shardwise.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=1024, block_size=64, n_layer=2, n_head=8, n_embd=512)
    torch.manual_seed(0)
    model = GPT(cfg)
    ids = (torch.randint(0, 1024, (4, 64)),)
    plan = sw.auto(model, TP2, ids)
    assert dict(plan) == cfg.tensor_parallel_plan() and plan.vocab_parallel_loss
    with pytest.raises(ValueError, match="share parameters") as info:
        sw.auto(model, TP2, ids, pins={"wte": "B", "lm_head": "vocab"})
    assert "\n" not in str(info.value)  # tied: one table, one layout
