"""Graph capture and cutting for ``sw.pipeline(..., example_inputs=...)``: pure, one process, no mesh.

What crosses a cut of a Hugging Face decoder, FLOP-balanced automatic splits, the bad inputs (split names,
stages without parameters, data-dependent control flow, shapes that differ from the capture, objects made inside
the forward that cannot be made anew), that a capture leaves the model and the random stream untouched, and that
objects made inside the forward (a ``use_cache=True`` decoder's cache) are made anew for every call.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from shardwise.parallel.pipeline.batching import normalize_example, split_graph
from shardwise.parallel.pipeline.capture import CaptureError
from shardwise.parallel.pipeline.graph_stage import build_graph_stages, leaf_modules, model_loss


def _llama(layers: int = 4, **config) -> nn.Module:
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, **{"use_cache": False, **config})
    return tf.LlamaForCausalLM(cfg)


def _example(b: int = 2, t: int = 8) -> tuple[tuple, dict]:
    ids = torch.arange(b * t).reshape(b, t) % 64
    return normalize_example({"labels": ids, "input_ids": ids})


def test_llama_cut_sends_hidden_states_position_ids_and_rotary_tables():
    stages = build_graph_stages(_llama(), 2, ["model.layers.2"], _example())
    graph = stages[0].graph
    assert stages[0].owned_names() == ["model.embed_tokens", "model.rotary_emb", "model.layers.0", "model.layers.1"]
    assert stages[1].owned_names() == ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    sent = [graph.nodes[k] for k in stages[0].send]
    assert stages[1].recv == stages[0].send
    metas = sorted((str(n.meta[0]), n.meta[1], n.requires_grad) for n in sent)
    assert metas == sorted([("torch.int64", (1, 8), False), ("torch.float32", (1, 8, 8), False),
                            ("torch.float32", (1, 8, 8), False), ("torch.float32", (2, 8, 32), True)])
    assert "module:model.layers.2" in graph.describe()


def test_two_stages_replayed_in_one_process_equal_the_model():
    model = _llama()
    example = _example()
    ref = model(*example[0], **example[1])
    stages = build_graph_stages(model, 3, None, example)
    values: list = []
    for s in stages:
        values = s(example, values)
    assert torch.equal(values.logits, ref.logits) and torch.equal(model_loss(values), ref.loss)


def test_one_tensor_passed_twice_is_captured_as_two_inputs():
    model = _llama(2)
    ids = torch.arange(16).reshape(2, 8) % 64
    stages = build_graph_stages(model, 2, None, normalize_example({"input_ids": ids, "labels": ids}))
    other = (ids + 1) % 64  # later steps pass different labels: the loss must use them, not the token ids
    mb = normalize_example({"input_ids": ids, "labels": other})
    out = stages[1](mb, stages[0](mb, []))
    assert torch.equal(model_loss(out), model(input_ids=ids, labels=other).loss)


def test_a_model_returning_a_tuple_gives_its_loss_from_the_last_stage():
    model = _llama(2)
    ids = torch.arange(16).reshape(2, 8) % 64
    example = normalize_example({"input_ids": ids, "labels": ids, "return_dict": False})
    stages = build_graph_stages(model, 2, None, example)
    out = stages[1](example, stages[0](example, []))
    assert isinstance(out, tuple) and torch.equal(model_loss(out), model(input_ids=ids, labels=ids).loss)


class _Wide(nn.Module):
    """Layer 0 does 16x the matmul work of each other layer: a FLOP balance gives it a stage alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(64, 64)] + [nn.Linear(64, 16) if i == 0 else nn.Linear(16, 16)
                                                           for i in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x.sum()


def test_automatic_split_balances_forward_flops():
    stages = build_graph_stages(_Wide(), 2, None, ((torch.randn(4, 64),), {}))
    # flops: 64*64, 64*16, 16*16 x3 -> {layer 0} = 4096 vs the rest = 1024 + 768: layer 0 alone
    assert stages[0].owned_names() == ["layers.0"]


def test_leaves_follow_layer_lists_and_split_names():
    model = _llama(2)
    leaves = leaf_modules(model)
    assert "model.layers.0" in leaves and "lm_head" in leaves and "model" not in leaves
    deeper = leaf_modules(model, ["model.layers.1.mlp"])
    assert "model.layers.1.mlp" in deeper and "model.layers.1.self_attn" in deeper and "model.layers.1" not in deeper


@pytest.mark.parametrize("split, message", [
    (["model.layer.2"], "not a module of LlamaForCausalLM; did you mean 'model.layers.2'"),
    (["model.layers"], "container of other cut points"),
    (["model.layers.3", "model.layers.1"], "not in forward order"),
    (["model.rotary_emb", "model.layers.0"], "without parameters"),
    (["model.layers.1"], "makes 2 stages but"),
])
def test_bad_splits_are_refused_with_the_fix(split, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        build_graph_stages(_llama(), 3, split, _example())


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # a branch on the inputs' values: one run cannot stand for every input
            x = x * 2
        return self.layers[1](self.layers[0](x)).sum()


def test_data_dependent_control_flow_names_the_construct_and_the_line():
    with pytest.raises(CaptureError, match=r"data-dependent control flow.*test_pipeline_graph.py:\d+.*nn.Sequential"):
        build_graph_stages(_Branchy(), 2, None, ((torch.randn(2, 4),), {}))


class _TensorMath(nn.Module):
    """Value-dependent tensor math without a Python decision on a value: captured, and replayed exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = (x > 0).any(dim=-1, keepdim=True).to(x.dtype)  # a tensor, not a branch
        rows = [row * (i + 1) for i, row in enumerate(x)]     # iteration: the shape decides, not the values
        return (self.layers[1](self.layers[0](torch.stack(rows))) * keep).sum()


def test_tensor_valued_reductions_and_iteration_are_not_refused():
    model = _TensorMath()
    stages = build_graph_stages(model, 2, None, ((torch.randn(3, 4),), {}))
    x = torch.randn(3, 4)
    x[1] = -x[1].abs()  # a row whose mask differs from the captured example's
    mb = ((x,), {})
    assert torch.allclose(stages[1](mb, stages[0](mb, [])), model(x))


def test_capture_changes_neither_buffers_nor_the_random_stream():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    wrapper = nn.Module()
    wrapper.layers = model
    wrapper.forward = lambda x: model(x).sum()  # type: ignore[method-assign]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    example = ((torch.randn(5, 4),), {})
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    build_graph_stages(wrapper, 2, None, example)
    assert torch.equal(torch.rand(3), expected)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_step_inputs_must_match_the_captured_micro_batch():
    stages = build_graph_stages(_llama(), 2, None, _example(b=2))
    graph = stages[0].graph
    ids = torch.zeros(8, 8, dtype=torch.long)
    mbs, targets = split_graph((), {"input_ids": ids, "labels": ids}, False, graph, 4, 1, 0, None,
                               torch.device("cpu"))
    assert len(mbs) == 4 and targets == [None] * 4 and mbs[0][1]["input_ids"].shape == (2, 8)
    with pytest.raises(ValueError, match="example_inputs must be one micro-batch"):
        split_graph((), {"input_ids": ids, "labels": ids}, False, graph, 2, 1, 0, None, torch.device("cpu"))
    with pytest.raises(ValueError, match="same arguments"):
        split_graph((), {"input_ids": ids}, False, graph, 4, 1, 0, None, torch.device("cpu"))


def test_model_loss_finds_the_loss_or_says_what_to_pass():
    loss = torch.tensor(2.0)
    assert model_loss({"loss": loss}) == 2.0 and model_loss((loss, torch.zeros(3))) == 2.0
    with pytest.raises(ValueError, match="give loss_fn="):
        model_loss(torch.zeros(2, 3))


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_cache_made_inside_the_forward_is_made_anew_for_every_call(checkpointed):
    model = _llama(use_cache=True)  # the default config: LlamaModel.forward makes a DynamicCache per call
    stages = build_graph_stages(model, 2, None, _example())
    made = stages[0].graph.made
    assert [m.kind for m in made] == ["DynamicCache"] and "modeling_llama.py" in made[0].where
    assert "DynamicCache(" in made[0].where
    for s in stages:
        s.checkpoint = checkpointed  # the recomputation in backward gets a new cache too
    for k in range(3):  # three calls, each with other tokens: nothing of one call reaches the next
        ids = (torch.arange(16).reshape(2, 8) * (k + 3)) % 64
        mb = normalize_example({"input_ids": ids, "labels": ids})
        out = stages[1](mb, stages[0](mb, []))
        model_loss(out).backward()
        got = _grads(model)
        ref = model(input_ids=ids, labels=ids)
        ref.loss.backward()
        assert torch.equal(out.logits, ref.logits) and torch.equal(model_loss(out), ref.loss)
        assert all(torch.allclose(got[n], g, rtol=1e-5, atol=1e-7) for n, g in _grads(model).items())
    assert all(layer.keys is None for layer in made[0].template.layers)  # the copy kept is the empty cache


class _Log:
    def __init__(self, owner: nn.Module) -> None:
        self.owner, self.calls = owner, []


class _Logged(nn.Linear):
    def forward(self, x: torch.Tensor, log: _Log) -> torch.Tensor:  # type: ignore[override]
        log.calls.append(len(log.calls))
        return super().forward(x) * len(log.calls)  # the output depends on what this call's log holds


class _LogModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), _Logged(4, 4), _Logged(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        log = _Log(self)
        x = self.layers[0](x)
        for layer in self.layers[1:]:
            x = layer(x, log)
        return x.sum()


def test_an_object_made_inside_the_forward_is_copied_per_call_and_shares_what_existed_before():
    model = _LogModel()
    stages = build_graph_stages(model, 2, ["layers.1"], ((torch.randn(2, 4),), {}))
    (made,) = stages[0].graph.made
    assert made.kind == "_Log" and "log = _Log(self)" in made.where and made.template.calls == []
    assert made.new().owner is model  # the model existed before the forward: shared, never copied
    x = torch.randn(2, 4)
    for _ in range(2):
        assert torch.allclose(stages[1](((x,), {}), stages[0](((x,), {}), [])), model(x))


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Locked:
    def __init__(self) -> None:
        self.lock = threading.Lock()


class _Carry(nn.Module):
    """Passes an object made in its forward to a layer: one that holds a tensor computed from the inputs, or
    one that cannot be copied."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList([nn.Linear(4, 4), _Take(), nn.Linear(4, 4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        holder = _Holder(x * 2) if self.kind == "tensor" else _Locked()
        return self.layers[2](self.layers[1](self.layers[0](x), holder)).sum()


class _Take(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 4)

    def forward(self, x: torch.Tensor, holder: object) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x + getattr(holder, "t", 0))


@pytest.mark.parametrize("kind, message", [
    ("tensor", r"a _Holder made inside the forward at \S*test_pipeline_graph.py:\d+ \(holder = _Holder\(x \* 2\) .*"
               r"holds tensors computed in the forward \(shapes \[\[2, 4\]\]\).*pass them to the modules"),
    ("lock", r"a _Locked made inside the forward at \S*test_pipeline_graph.py:\d+ .*copy.deepcopy fails "
             r"\(TypeError: .*lock.*\); give _Locked a working __deepcopy__"),
])
def test_an_object_made_inside_the_forward_that_cannot_be_made_anew_is_refused(kind, message):
    with pytest.raises(CaptureError, match=message) as err:
        build_graph_stages(_Carry(kind), 2, None, ((torch.randn(2, 4),), {}))
    assert "\n" not in str(err.value) and "use_cache=False" in str(err.value)
