"""Rank-side checks for ``Pipeline.evaluate`` (run by tests/dist/test_pipeline_eval.py through LocalWorld).

Reference: the same model (same seed) on one device, in eval mode under ``no_grad``, on the whole batch —
computed locally on every rank by code the pipeline never touches; the trained reference uses the same
optimizer on the same batches. Each case runs one pipeline with ``evaluate`` calls between its steps and a
second, identical pipeline without them: the two must train to the same bits.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from shardwise.parallel.tensor.apply_plan import gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh
from tests.dist.pipeline_graph_checks import SEQ, VOCAB, Out, _model as _graph_model
from tests.dist.pipeline_hybrid_checks import _factory

BATCH, GPT_SEQ, GPT_VOCAB = 8, 8, 64


def _gpt(case: dict) -> nn.Module:
    torch.manual_seed(1234)
    return GPT(GPTConfig(n_layer=case.get("n_layer", 2), n_embd=32, n_head=2, vocab_size=GPT_VOCAB, block_size=16,
                         dropout=case.get("dropout", 0.0)))


def _sum_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The override: summed (not mean) token cross-entropy, so a wrong averaging would show."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")


def _sum_graph(out: Out, targets: torch.Tensor) -> torch.Tensor:
    return _sum_ce(out.logits, targets)


def _batches(case: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Three batches: the validation batch, then two training batches."""
    g = torch.Generator().manual_seed(7)
    if case["model"] == "gpt":
        return [synthetic_batch(BATCH, GPT_SEQ, GPT_VOCAB, generator=g) for _ in range(3)]
    ids = [torch.randint(0, VOCAB, (BATCH, SEQ), generator=g) for _ in range(3)]
    return [(x, x) for x in ids]  # the Toy decoder's labels are its inputs


class _Run:
    """How a case calls its model: on one device, and through the pipeline (chain or keyword inputs)."""

    def __init__(self, case: dict) -> None:
        self.graph = case["model"] != "gpt"

    def ref_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, fn: Callable | None) -> torch.Tensor:
        if self.graph:
            out = model(input_ids=x, labels=y)
            return out.loss if fn is None else fn(out, y)
        return (fn or lm_loss)(model(x), y)

    def step(self, pipe: Any, x: torch.Tensor, y: torch.Tensor) -> float:
        return pipe.step(input_ids=x, labels=y) if self.graph else pipe.step(x, y)

    def evaluate(self, pipe: Any, x: torch.Tensor, y: torch.Tensor, fn: Callable | None = None) -> float:
        if not self.graph:
            return pipe.evaluate(x, y, loss_fn=fn)
        if fn is None:  # the model's own loss
            return pipe.evaluate(input_ids=x, labels=y)
        return pipe.evaluate(y, input_ids=x, labels=y, loss_fn=fn)  # an override takes the targets last


def _reference(case: dict) -> dict[str, Any]:
    """One device: eval losses at the start and after the first optimizer step, the override's, and the
    training losses and final weights (dropout draws differ from the pipeline's: compare those only without)."""
    run, (v, vy), (t1, y1), (t2, y2) = _Run(case), *_batches(case)
    model = _graph_model(case["model"]) if run.graph else _gpt(case)
    opt = _factory(case)(model.parameters())

    def evaluate(fn: Callable | None = None) -> float:
        model.eval()
        with torch.no_grad():
            loss = float(run.ref_loss(model, v, vy, fn))
        model.train()
        return loss

    # the override sums over tokens: the pipeline averages those sums over m micro-batches and dp replicas
    out: dict[str, Any] = {"e0": evaluate(), "override": evaluate(_override(case, None)) / _parts(case)}
    train = []
    for x, y in ((t1, y1), (t2, y2)):
        loss = run.ref_loss(model, x, y, None)
        loss.backward()
        train.append(loss.item())
        opt.step()
        opt.zero_grad()
        if "e1" not in out:
            out["e1"] = evaluate()
    out["train"], out["state"] = train, {k: t.detach().clone() for k, t in model.state_dict().items()}
    return out


def _parts(case: dict) -> int:
    return case["m"] * case.get("axes", {}).get("dp", 1)


def _override(case: dict, m: sw.Mesh | None) -> Callable:
    if case["model"] != "gpt":
        return _sum_graph
    if m is not None and "tp" in m.axes:
        return partial(vocab_parallel_cross_entropy, mesh=m, axis="tp", reduction="sum")
    return _sum_ce


def _build(case: dict) -> tuple[sw.Mesh, Any]:
    axes = case.get("axes", dict(pp=2))
    m = mesh(**axes)
    if case["model"] != "gpt":
        rows = BATCH // case["m"] // axes.get("dp", 1)
        example = {"input_ids": torch.zeros(rows, SEQ, dtype=torch.long)}
        example["labels"] = example["input_ids"]
        return m, sw.pipeline(_graph_model(case["model"]), m, "pp", microbatches=case["m"], loss_fn=None,
                              schedule=case["schedule"], chunks=case.get("chunks", 1), example_inputs=example)
    model, loss_fn = _gpt(case), lm_loss
    if "tp" in axes:
        model = sw.parallelize(model, m, gpt_plan(model.config), axis="tp")
        loss_fn = partial(vocab_parallel_cross_entropy, mesh=m, axis="tp")
    return m, sw.pipeline(model, m, "pp", microbatches=case["m"], schedule=case["schedule"], loss_fn=loss_fn,
                          chunks=case.get("chunks", 1), dp_axis="dp" if "dp" in axes else None,
                          zero_stage=case.get("zero", 0), checkpoint=case.get("ckpt", False))


def _counts(c: sw.comm.CommCounter) -> dict[str, int]:
    return {"send": c.count("send"), "recv": c.count("recv"), "dp_all_reduce": c.count("all_reduce", axis="dp"),
            "reduce_scatter": c.count("reduce_scatter"), "all_gather": c.count("all_gather", axis="dp"),
            "pp_broadcast": c.count("broadcast", axis="pp")}


def _saved_by(fn: Callable[[], float]) -> tuple[float, int]:
    """``fn()`` and how many tensors autograd saved for a backward while it ran."""
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = fn()
    return value, saved[0]


def _train(case: dict, with_eval: bool) -> dict[str, Any]:
    """Two optimizer steps; with ``with_eval``, evaluations before, between and after the first step's parts."""
    m, pipe = _build(case)
    run, opt = _Run(case), pipe.build_optimizer(_factory(case))
    (v, vy), (t1, y1), (t2, y2) = _batches(case)
    out: dict[str, Any] = {"coord": m.coord("pp"), "p": m.size("pp")}
    if with_eval:
        with sw.comm.CommCounter() as c:
            out["e0"] = run.evaluate(pipe, v, vy)
        out["first_counts"], out["grads_none"] = _counts(c), all(q.grad is None for q in pipe.parameters())
    torch.manual_seed(99)  # the same dropout draws in both runs
    out["train"] = [run.step(pipe, t1, y1)]
    if with_eval:
        grads = [None if q.grad is None else q.grad.clone() for q in pipe.parameters()]
        events, peak = pipe.last_events, pipe.last_peak_held
        with sw.comm.CommCounter() as c:
            out["e_mid"], out["eval_saved"] = _saved_by(lambda: run.evaluate(pipe, v, vy))
        out["later_counts"] = _counts(c)
        out["override"] = run.evaluate(pipe, v, vy, _override(case, m))
        out["grads_same"] = all((g is None and q.grad is None) or (g is not None and q.grad is not None and
                                                                     torch.equal(g, q.grad))
                                for g, q in zip(grads, pipe.parameters()))
        out["events_same"] = pipe.last_events is events and pipe.last_peak_held == peak and len(events) > 0
        out["modes_restored"] = all(mod.training for s in pipe.stages.values() for mod in s.modules())
    opt.step()
    opt.zero_grad()
    if with_eval:
        out["e1"] = run.evaluate(pipe, v, vy)
    torch.manual_seed(98)
    loss, out["step_saved"] = _saved_by(lambda: run.step(pipe, t2, y2))
    out["train"].append(loss)
    opt.step()
    opt.zero_grad()
    out["state"] = sw.full_state_dict(pipe)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _run_case(case: dict) -> dict[str, Any]:
    ref, a, b = _reference(case), _train(case, True), _train(case, False)
    exact = "dropout" not in case  # with dropout only the first evaluation (untrained weights) has a reference
    out = {k: a[k] for k in ("coord", "p", "first_counts", "later_counts", "grads_none", "grads_same",
                              "events_same", "modes_restored", "eval_saved", "step_saved")}
    out |= {
        "e0_err": _rel(a["e0"], ref["e0"]),
        "override_err": _rel(a["override"], ref["override"]),
        "override_vs_default": a["override"] / a["e0"],
        "mid_same": a["e_mid"] == a["e0"],  # gradients held by the step change nothing
        "e1_err": _rel(a["e1"], ref["e1"]) if exact else 0.0,
        "train_err": max(_rel(x, r) for x, r in zip(a["train"], ref["train"])) if exact else 0.0,
        "param_err": max(float((a["state"][k] - t).abs().max() / t.abs().max()) for k, t in ref["state"].items())
        if exact else 0.0,
        # the run with evaluations trains to the same bits as the run without
        "same_training": a["train"] == b["train"] and sorted(a["state"]) == sorted(b["state"])
        and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]),
    }
    return out


def check_evaluate(cases: list[dict]) -> list[dict[str, Any]]:
    return [_run_case(case) for case in cases]


def check_bad_evaluate() -> dict[str, str]:
    """Each bad call's message; none of them communicates (every rank raises alike, before any message)."""
    _, pipe = _build(dict(model="gpt", schedule="1f1b", m=2))
    x, y = _batches(dict(model="gpt"))[0]
    calls = {"one_tensor": lambda: pipe.evaluate(x), "keywords": lambda: pipe.evaluate(x, y, input_ids=x),
             "loss_not_callable": lambda: pipe.evaluate(x, y, loss_fn="sum"),
             "rows": lambda: pipe.evaluate(x[:3], y[:3])}
    out = {}
    for name, call in calls.items():
        with sw.comm.CommCounter() as c:
            try:
                call()
                out[name] = ""
            except (TypeError, ValueError) as e:
                out[name] = str(e)
        assert not c.records and c.messages_sent == 0, (name, c.records)
    return out
