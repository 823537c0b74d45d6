"""Rank-side checks of document masking in parallel layouts (run by tests/dist/test_document_mask.py).

Every rank builds the same model and packed rows from one seed and the one-process reference with the document
mask on the whole rows (which tests/unit/test_document_mask.py checks against each document run alone). Reported:
relative errors (max |a − b| / max |b|) of logits, losses and parameters after one SGD step, and the messages
the forward sent.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.parallel.context import context_parallel, shard_sequence
from shardwise.parallel.context.documents import microbatch_documents
from tests.dist.meshes import mesh as cached_mesh

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
EOS = 3
LR = 0.1


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max().clamp_min(1e-30))


def _model(kind: str, ckpt: bool = False) -> torch.nn.Module:
    torch.manual_seed(1)
    if kind == "gpt":
        model = sw.models.GPT(dataclasses.replace(sw.models.GPTConfig.preset("gpt-tiny"), n_layer=4))
        blocks = "blocks."
    else:
        from shardwise.models.hf_config import load_hf_config
        from shardwise.models.llama import Llama
        model = Llama(load_hf_config(EXAMPLES / "tiny-llama.json"), block_size=32)
        blocks = "model.layers."
    if ckpt:  # recomputed in backward: the documents must reach the recomputation too
        depth = blocks.count(".")
        sw.checkpoint_layers(model, policy=lambda name, _m: name.startswith(blocks) and name.count(".") == depth)
    model.document_eos_id = EOS
    return model


def _rows(vocab: int, b: int = 2, S: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed rows: row 0 ends documents at 4 and 11 (one inside a cp chunk, one across), row 1 at 6 and 7
    (a one-token document), the last document of each row cut by the row's end."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(EOS + 1, vocab, (b, S), generator=g)
    ids[0, [4, 11]] = EOS
    ids[1 % b, [6, 7]] = EOS
    return ids, torch.randint(0, vocab, (b, S), generator=g)


def _loss(logits: torch.Tensor, targets: torch.Tensor, scale: int) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum") / scale


def _counted(fn: Any) -> tuple[Any, dict[str, int]]:
    with sw.comm.CommCounter() as c:
        result = fn()
    return result, {"sends": c.count("send"), "all_gather": c.count("all_gather")}


def check_cp(axes: dict, kind: str, ckpt: bool) -> dict:
    """Local logits and every parameter gradient (summed over cp) against one process with the same mask."""
    mesh = cached_mesh(**axes)
    model = _model(kind, ckpt)
    cp_model = context_parallel(copy.deepcopy(model), mesh, "cp")
    vocab = model.lm_head.weight.size(0)
    ids, targets = _rows(vocab)
    logits = model(ids)
    _loss(logits, targets, ids.numel()).backward()
    local_ids, local_t = shard_sequence(ids, mesh, "cp"), shard_sequence(targets, mesh, "cp")
    local_logits, counts = _counted(lambda: cp_model(local_ids))
    _loss(local_logits, local_t, ids.numel()).backward()
    grads = dict(cp_model.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        total = sw.comm.all_reduce(grads[name].grad.clone(), mesh, "cp")
        worst = max(worst, rel(total, p.grad))
    unmasked = copy.deepcopy(model)
    unmasked.document_eos_id = None
    return {"logits": rel(local_logits, shard_sequence(logits, mesh, "cp")), "grads": worst, "fwd": counts,
            "cp": mesh.size("cp"), "unmasked": rel(shard_sequence(unmasked(ids), mesh, "cp"),
                                                   shard_sequence(logits, mesh, "cp"))}


def _sgd_step(model: torch.nn.Module, fn: Any) -> float:
    loss = fn()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= LR * p.grad
    return float(loss)


def check_tp(kind: str) -> dict:
    """``sw.parallelize`` over tp 2 (attention and MLP split in whole heads): logits, and parameters after one
    SGD step, against one process."""
    mesh = cached_mesh(tp=2)
    model = _model(kind)
    ref = copy.deepcopy(model)
    plan = {k: v for k, v in model.tensor_parallel_plan().items() if "." in k and "embed" not in k}  # blocks only
    tp_model = sw.parallelize(model, mesh, plan)
    ids, targets = _rows(ref.lm_head.weight.size(0))
    out = tp_model(ids)
    want = ref(ids)
    _sgd_step(tp_model, lambda: _loss(tp_model(ids), targets, ids.numel()))
    _sgd_step(ref, lambda: _loss(ref(ids), targets, ids.numel()))
    full = sw.full_state_dict(tp_model)
    return {"logits": rel(out, want), "params": max(rel(full[k], v) for k, v in ref.state_dict().items())}


def check_pp(kind: str, schedule: str, checkpoint: str, hook: bool = True) -> dict:
    """``sw.pipeline`` over pp 2 (4 micro-batches of one row): the step's loss and the parameters after one SGD
    step against one process; ``hook``: the documents' ``microbatch_context`` (without it the stages run
    unmasked, which the test sees as a mismatch)."""
    mesh = cached_mesh(pp=2)
    model = _model(kind)
    ref = copy.deepcopy(model)
    ids, targets = _rows(ref.lm_head.weight.size(0), b=4)

    def loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return _loss(logits, tgt, tgt.numel())

    pipe = sw.pipeline(model, mesh, "pp", microbatches=4, schedule=schedule, loss_fn=loss_fn, checkpoint=checkpoint)
    if hook:
        pipe.interpreter.microbatch_context = microbatch_documents(EOS, lambda: None)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    loss = pipe.step(ids, targets)
    opt.step()
    evaluated = pipe.evaluate(ids, targets)
    ref_loss = _sgd_step(ref, lambda: loss_fn(ref(ids), targets))
    with torch.no_grad():
        ref_eval = float(loss_fn(ref(ids), targets))
    full = sw.full_state_dict(pipe)
    return {"loss": abs(loss - ref_loss) / abs(ref_loss), "eval": abs(evaluated - ref_eval) / abs(ref_eval),
            "params": max(rel(full[k], v) for k, v in ref.state_dict().items())}
