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


# -- the runtime: shardwise train's strategies with data.document_mask ---------------------------------------

STEPS, G, T, V = 2, 8, 32, 256
SMALL = {"data.global_batch": str(G), "parallel.micro_batch": "2", "optimizer.warmup_steps": "0",
         "optimizer.name": "sgd", "optimizer.lr": "0.5", "optimizer.weight_decay": "0", "optimizer.schedule": "constant",
         "model.n_layer": "2", "model.block_size": str(T), "train.steps": str(STEPS)}
RUNTIME: dict[str, dict[str, str]] = {
    "dp2": {}, "tp2": {"parallel.tp": "2"},
    "zero3-ckpt": {"parallel.zero_stage": "3", "parallel.activation_checkpointing": "full"},
    "pp2": {"parallel.pp": "2", "parallel.pp_schedule": "1f1b", "parallel.activation_checkpointing": "full"},
    "cp2": {"parallel.cp": "2"},
}


def packed_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(G, T) rows of random ids with an EOS after documents of random lengths (1 to 12 tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(EOS + 1, V, (G, T), generator=g)
    x[torch.rand(G, T, generator=g) < 0.12] = EOS
    return x, torch.randint(0, V, (G, T), generator=g)


def run_runtime(name: str, world: Any) -> dict[str, Any]:
    """The real ``Trainer`` of layout ``name`` with the documents of ``packed_batch``: step losses and weights."""
    import tempfile

    from shardwise.data.sources import TrainData
    from shardwise.runtime import trainer as trainer_mod
    from shardwise.runtime.config import load_config, validate
    from shardwise.runtime.documents import enable_documents
    from shardwise.runtime.step_support import mesh_axes

    n = world.world_size
    cfg = validate(load_config(overrides={**SMALL, **RUNTIME[name], "parallel.nproc": str(n)}))
    trainer_mod._build_mesh = lambda *_: cached_mesh(**mesh_axes(cfg.parallel))
    t = trainer_mod.Trainer(cfg, Path(tempfile.mkdtemp()), world)  # the generated corpus: no EOS, mask off
    on = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, document_mask="true"))
    assert enable_documents(on, t.strategy, TrainData(None, None, masked=True, eos_id=EOS)) == EOS  # type: ignore[arg-type]
    p = cfg.parallel
    dp_size, dp_rank = t.strategy.data_shard()
    if t.split is not None and dp_size > 1:
        dp_size, dp_rank = dp_size // p.cp, dp_rank // p.cp
    micro = p.micro_batch * p.dp // dp_size

    def rows(seed: int) -> list:
        x, y = packed_batch(seed)
        pairs = list(zip(x[dp_rank::dp_size].split(micro), y[dp_rank::dp_size].split(micro)))
        return t.split(pairs) if t.split is not None else pairs

    steps = iter([rows(100 + s) for s in range(STEPS)])
    t.data.next = lambda: next(steps)  # type: ignore[method-assign]
    losses = [t.train_step()[0] for _ in range(STEPS)]
    return {"losses": losses, "params": {k: v.float().cpu() for k, v in sw.full_state_dict(t.model).items()}}


def check_runtime(names: list[str]) -> list[dict[str, Any]]:
    import torch.distributed as dist

    from shardwise.world import World

    world = World(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=dist.get_rank(),
                  backend="gloo", device=torch.device("cpu"))
    return [run_runtime(name, world) for name in names]


def runtime_reference() -> dict[str, Any]:
    """One process, plain torch: the GPT with the mask on the whole global batch, SGD with the run's momentum."""
    from shardwise.runtime.config import load_config, validate

    cfg = validate(load_config(overrides={**SMALL, "parallel.nproc": "1"}))
    torch.manual_seed(cfg.train.seed)
    model = sw.models.GPT(cfg.model)
    model.document_eos_id = EOS
    opt = torch.optim.SGD(model.parameters(), lr=cfg.optimizer.lr, momentum=cfg.optimizer.beta1)
    losses, unmasked = [], []
    for s in range(STEPS):
        x, y = packed_batch(100 + s)
        loss = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        with torch.no_grad():
            model.document_eos_id = None
            unmasked.append(float(F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))))
            model.document_eos_id = EOS
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {"losses": losses, "unmasked": unmasked,
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
