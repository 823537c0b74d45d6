"""Rank-side checks for meta-device construction (run in LocalWorld ranks by tests/dist/test_meta_construction.py).

Each check builds the model on the meta device, hands it to a layout's wrapper, and compares with one process
that built the same model for real from the same seed: the initial full state must be bit-identical (the
values do not depend on the layout), two SGD steps must agree to float noise, and the rank must hold only
its share of the parameters (bytes counted) and broadcast nothing it drew itself (collectives counted).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.checkpoint.zero_layout import zero_model_pieces
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.tensor.apply_plan import vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

CFG = GPTConfig(vocab_size=40, block_size=8, n_layer=2, n_head=4, n_embd=16, bias=True)
B, SEQ, STEPS, LR = 8, 8, 2, 0.1


class Plain(nn.Module):
    """A user model with no ``param_init``: its layers' own ``reset_parameters`` start it (seeded per module)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 10), nn.Linear(10, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.b(torch.tanh(self.a(x))))


def _gpt(meta: bool) -> nn.Module:
    torch.manual_seed(7)
    if not meta:
        return GPT(CFG)
    with torch.device("meta"):
        return GPT(CFG)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    stream = torch.randint(0, CFG.vocab_size, (B, SEQ + 1), generator=g)
    return stream[:, :-1], stream[:, 1:]


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(initial state, state after STEPS SGD steps) of one process on the whole batch."""
    model = _gpt(meta=False)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(STEPS):
        x, y = _batch(s)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return init, model.state_dict()


def _rows(x: torch.Tensor, m: sw.Mesh) -> torch.Tensor:
    if "dp" not in m.axes:
        return x
    n, c = m.size("dp"), m.coord("dp")
    return x[c * B // n:(c + 1) * B // n]


def _wrap(layout: str, m: sw.Mesh) -> tuple[Any, torch.optim.Optimizer, Any]:
    """(model, optimizer, step function) of ``layout`` over a meta-built GPT."""
    model = _gpt(meta=True)
    sgd = functools.partial(torch.optim.SGD, lr=LR)
    if layout.startswith("zero"):
        if "tp" in m.axes:
            model = sw.parallelize(model, m, CFG.tensor_parallel_plan(), axis="tp")
        model, opt = sw.zero(model, m, stage=int(layout[-1]), optimizer=sgd, axis="dp")
        loss = _tp_loss(m) if "tp" in m.axes else lm_loss
        return model, opt, lambda x, y: loss(model(_rows(x, m)), _rows(y, m)).backward()
    if layout == "pp-graph":  # the forward captured on the meta model, each rank materialises its stages
        example = _batch(0)[0][:B // m.size("dp") // 2]
        pipe = sw.pipeline(model, m, "pp", microbatches=2, schedule="1f1b", loss_fn=lm_loss, dp_axis="dp",
                           example_inputs=(example,))
        return pipe, sgd(list(pipe.parameters())), lambda x, y: pipe.step(x, y)
    if layout == "pp-tp":  # the tp pieces stay meta until the pipeline materialises this rank's stages
        model = sw.parallelize(model, m, CFG.tensor_parallel_plan(), axis="tp")
        pipe = sw.pipeline(model, m, "pp", microbatches=2, schedule="1f1b", loss_fn=_tp_loss(m))
        return pipe, sgd(list(pipe.parameters())), lambda x, y: pipe.step(x, y)
    if layout == "pp":
        pipe = sw.pipeline(model, m, "pp", microbatches=2, schedule="1f1b", loss_fn=lm_loss,
                           dp_axis="dp" if "dp" in m.axes else None)
        return pipe, sgd(list(pipe.parameters())), lambda x, y: pipe.step(x, y)
    if layout == "tp":
        model = sw.materialize(sw.parallelize(model, m, CFG.tensor_parallel_plan(), axis="tp"), m)
        return model, sgd(model.parameters()), lambda x, y: _tp_loss(m)(model(x), y).backward()
    dp = sw.DataParallel(model, m, axis="dp")
    return dp, sgd(model.parameters()), lambda x, y: lm_loss(dp(_rows(x, m)), _rows(y, m)).backward()


def _tp_loss(m: sw.Mesh) -> Any:
    return functools.partial(vocab_parallel_cross_entropy, mesh=m, axis="tp", vocab_size=CFG.vocab_size)


def _held_bytes(model: Any, opt: torch.optim.Optimizer) -> int:
    """Parameter bytes this rank holds (what the optimizer steps: a ZeRO-3 shard, a stage, a tp piece)."""
    return sum(p.numel() * p.element_size() for g in opt.param_groups for p in g["params"])


def _max_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - v).abs().max() / v.abs().max().clamp_min(1e-12)) for k, v in want.items())


def check_layout(layout: str, axes: dict[str, int]) -> dict[str, Any]:
    """One layout over a meta-built GPT against the one-process reference."""
    m = mesh(**axes)
    init, trained = _reference()
    with CommCounter() as built:
        model, opt, step = _wrap(layout, m)
    start = sw.full_state_dict(model)
    same_init = all(torch.equal(start[k], v) for k, v in init.items())
    for s in range(STEPS):
        step(*_batch(s))
        opt.step()
        opt.zero_grad()
    whole = sum(v.numel() * v.element_size() for k, v in init.items() if k != "lm_head.weight")  # tied
    out = {"same_init": same_init, "err": _max_err(sw.full_state_dict(model), trained),
           "held": _held_bytes(model, opt), "whole": whole, "broadcasts": built.count("broadcast")}
    if layout.startswith("zero"):
        with CommCounter() as saved:  # the checkpoint's pieces: each rank's own flat ranges, no gather
            zero_model_pieces(model, m)
        out.update(save_gathers=saved.count("all_gather"), groups=len(model.groups),
                   in_flight=model._reducer.peak_in_flight)
    return out


def check_layouts(layouts: list[tuple[str, dict[str, int]]]) -> list[dict[str, Any]]:
    return [check_layout(layout, axes) for layout, axes in layouts]


def check_user_model(axes: dict[str, int]) -> dict[str, Any]:
    """A model without ``param_init`` under ZeRO-3: its initial state equals ``sw.materialize`` of the same meta
    model on one process (the one-device reference of a meta-built model)."""
    m = mesh(**axes)
    ref = sw.materialize(_fresh_plain(3), "cpu").state_dict()
    wrapped, _ = sw.zero(_fresh_plain(3), m, stage=3, optimizer=functools.partial(torch.optim.SGD, lr=LR), axis="dp")
    got = sw.full_state_dict(wrapped)
    return {"same_init": all(torch.equal(got[k], v) for k, v in ref.items()),
            "differs_per_layer": not torch.equal(ref["a.weight"][:6, :6], ref["b.weight"][:6, :6])}


def _fresh_plain(seed: int) -> nn.Module:
    with torch.device("meta"):
        model = Plain()
    model.init_seed = seed  # type: ignore[assignment]
    return model


def check_hf_meta_pipeline(directory: str) -> dict[str, Any]:
    """A ``transformers`` Llama built on the meta device, its weights attached from a Hugging Face directory
    (``sw.load_pretrained``: sources only) and pipelined from its captured forward: each rank reads its stages;
    the step's loss and the full state equal ``from_pretrained``'s (its rotary ``inv_freq`` buffer comes from the
    model's own ``_init_weights``)."""
    import transformers

    m = mesh(pp=2)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    sw.load_pretrained(model, directory)
    ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
    pipe = sw.pipeline(model, m, "pp", microbatches=2, schedule="1f1b", split=["model.layers.1"],
                       example_inputs={"input_ids": ids[:2], "labels": ids[:2]})
    loss = pipe.step(input_ids=ids, labels=ids)
    ref = transformers.AutoModelForCausalLM.from_pretrained(directory).float()
    with torch.no_grad():
        want = float(ref(input_ids=ids, labels=ids).loss)
    full = sw.full_state_dict(pipe)
    return {"err": abs(loss - want) / want, "same": all(torch.equal(full[k], v) for k, v in ref.state_dict().items())}
