"""Rank-side checks for frozen parameters (``requires_grad=False``) in every layout, run by
tests/dist/test_frozen.py inside LocalWorld ranks.

The model is the reference GPT with a frozen base in the shape fine-tuning gives it: the (tied) embedding,
the position embedding, every attention ``qkv`` and ``proj.weight`` and the whole middle block are frozen;
the norms, the MLPs, the attention output biases (a module with a frozen weight and a trainable bias) and
``ln_f`` train. Reference: one process, the whole batch, plain ``torch.optim.AdamW`` over the trainable
parameters. Each layout returns the losses, the trained state and what it holds or sends for the frozen part.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig, lm_loss
from shardwise.parallel.tensor.apply_plan import gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

CFG = GPTConfig(vocab_size=37, block_size=8, n_layer=3, n_head=2, n_embd=12, bias=True)
GLOBAL_B, SEQ, STEPS = 8, 6, 3
# eps 1e-5 as in the ZeRO tests: m/sqrt(v) of near-zero gradients would amplify summation-order noise
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-5, weight_decay=0.1)


def is_frozen(name: str) -> bool:
    """The frozen base: embeddings, attention qkv and proj weights, all of block 1."""
    return (name.startswith(("wte.", "wpe.", "lm_head.", "blocks.1.")) or ".attn.qkv." in name
            or name.endswith("attn.proj.weight"))


def build(seed: int = 0, ckpt: bool = False) -> GPT:
    torch.manual_seed(seed)
    model = GPT(CFG)
    for name, p in model.named_parameters():
        p.requires_grad_(not is_frozen(name))
    return sw.checkpoint_layers(model) if ckpt else model  # type: ignore[return-value]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, CFG.vocab_size, (GLOBAL_B, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def local(t: torch.Tensor, m: sw.Mesh, axis: str = "dp") -> torch.Tensor:
    n, i = m.size(axis), m.coord(axis)
    per = t.shape[0] // n
    return t[i * per:(i + 1) * per]


def trainable_numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, whole batch, AdamW over the trainable parameters only."""
    model = build()
    opt = ADAMW([p for p in model.parameters() if p.requires_grad])
    losses = []
    for s in range(STEPS):
        loss = lm_loss(model(batch(s)[0]), batch(s)[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compare(losses: list[float], state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Errors against the reference: losses and trainable tensors relative; frozen tensors bit-identical to
    the untrained start (and to the reference, which never moves them)."""
    ref_losses, ref_state = reference()
    start = build().state_dict()
    frozen = [k for k in ref_state if is_frozen(k)]
    err = max(float((state[k].double() - v.double()).abs().max()) / (1e-3 + float(v.double().abs().max()))
              for k, v in ref_state.items() if not is_frozen(k))
    return {"loss_err": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)), "param_err": err,
            "frozen_exact": all(torch.equal(state[k], start[k]) for k in frozen),
            "trained": any(not torch.equal(state[k], start[k]) for k in ref_state if not is_frozen(k)),
            "keys_ok": sorted(state) == sorted(ref_state)}


def _state_numel(opt: Any) -> int:
    inner = getattr(opt, "optimizer", opt)
    return sum(v.numel() for s in inner.state.values() for k, v in s.items()
               if isinstance(v, torch.Tensor) and k == "exp_avg")


def check_data_parallel() -> dict[str, Any]:
    """dp over every rank: one all-reduce byte per trainable gradient byte, none for frozen ones."""
    m = mesh(dp=-1)
    model = sw.DataParallel(build(), m, bucket_cap_mb=1000 / 2**20, first_bucket_mb=200 / 2**20)
    opt = ADAMW([p for p in model.parameters() if p.requires_grad])
    losses, sent = [], []
    for s in range(STEPS):
        x, y = (local(t, m) for t in batch(s))
        with CommCounter() as c:
            loss = lm_loss(model(x), y)
            loss.backward()
        sent.append(c.bytes("all_reduce", axis="dp"))
        opt.step()
        opt.zero_grad()
        losses.append(_mean_loss(loss, m))
    slots = sum(b.numel() for b in _bucket_buffers(model))
    out = compare(losses, {k: v.detach() for k, v in model.module.state_dict().items()})
    out.update(sent=sent, want_bytes=4 * trainable_numel(model.module), slots=slots,
               frozen_grads=sum(p.grad is not None for p in model.module.parameters() if not p.requires_grad))
    return out


def _bucket_buffers(model: Any) -> list[torch.Tensor]:
    reducer = model._reducer
    return list(reducer.buffers) + [v for v, p in zip(reducer.views, reducer.params) if not p.requires_grad]


def _mean_loss(loss: torch.Tensor, m: sw.Mesh, axis: str = "dp") -> float:
    t = loss.detach().clone()
    sw.comm.all_reduce(t, m, axis, op="avg")
    return float(t)


def check_zero(stage: int) -> dict[str, Any]:
    """sw.zero over every rank: frozen parameters in no trainable group, no reduce-scatter or optimizer
    state of theirs; at stage 3 they are sharded too (their own groups: gathered, never reduced)."""
    m = mesh(dp=-1)
    model, opt = sw.zero(build(), m, stage=stage, optimizer=ADAMW, bucket_cap_mb=1000 / 2**20,
                         first_bucket_mb=200 / 2**20)
    resident = _watch_frozen(model)
    losses, rs_bytes, ag_bytes, after = [], [], [], []
    for s in range(STEPS):
        x, y = (local(t, m) for t in batch(s))
        with CommCounter() as c:
            loss = lm_loss(model(x), y)
            loss.backward()
        rs_bytes.append(c.bytes("reduce_scatter", axis="dp"))
        ag_bytes.append(c.bytes("all_gather", axis="dp"))
        after.append(sum(g.gathered for g in model.flat_groups))
        opt.step()
        losses.append(_mean_loss(loss, m))
    out = compare(losses, sw.full_state_dict(model))
    n = m.size("dp")
    group_names = [name for g in model.groups for name in g.names]
    frozen_groups = getattr(model, "frozen_groups", [])
    frozen_held = sum(p.numel() for p in model.module.parameters() if not p.requires_grad)
    out.update(stage=stage, rs_bytes=rs_bytes, trainable=trainable_numel(model.module), n=n,
               frozen_in_groups=[k for k in group_names if is_frozen(k)],
               state_numel=_state_numel(opt), frozen_numel_held=frozen_held,
               frozen_shard_numel=sum(g.hi - g.lo for g in frozen_groups),
               frozen_total=sum(p.numel() for p in build().parameters() if not p.requires_grad),
               memory=sw.memory_report(model, opt), ag_bytes=ag_bytes, gathered_after_backward=after,
               max_frozen_resident=max(resident, default=0),
               frozen_units=[g.layout.total for g in frozen_groups], shard_numel=[g.hi - g.lo for g in frozen_groups],
               trainable_shard_numel=[g.hi - g.lo for g in model.groups])
    return out


def _watch_frozen(model: Any) -> list[int]:
    """Stage 3: after every gather of a frozen group, the frozen elements gathered on this rank."""
    seen: list[int] = []
    for g in getattr(model, "frozen_groups", []):
        def finish(handle: Any, _g: Any = g, _orig: Any = g.finish_gather) -> None:
            _orig(handle)
            seen.append(sum(f.layout.total for f in model.frozen_groups if f.gathered))
        g.finish_gather = finish
    return seen


def check_all_frozen() -> dict[str, str]:
    """A model with nothing to train: one-line errors from every wrapper."""
    m = mesh(dp=-1)
    out = {}
    for name, wrap in (("dp", lambda mod: sw.DataParallel(mod, m)),
                       ("zero3", lambda mod: sw.zero(mod, m, stage=3, optimizer=ADAMW))):
        model = build()
        model.requires_grad_(False)
        try:
            wrap(model)
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out


def check_tensor_parallel(sp: bool = False) -> dict[str, Any]:
    """tp over every rank (Megatron plan, vocab-parallel loss; ``sp``: sequence parallel, whose gradient regions
    of replicated parameters include all-frozen ones): the frozen shards stay frozen and unchanged, the trainable
    ones train as one process."""
    m = mesh(tp=-1)
    model = sw.parallelize(build(), m, gpt_plan(CFG, sequence_parallel=sp), axis="tp", sequence_parallel=sp)
    loss_fn = functools.partial(vocab_parallel_cross_entropy, mesh=m, axis="tp")
    opt = ADAMW([p for p in model.parameters() if p.requires_grad])
    frozen_flags = {n: not p.requires_grad for n, p in model.named_parameters()}
    losses = []
    for s in range(STEPS):
        loss = loss_fn(model(batch(s)[0]), batch(s)[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    out = compare(losses, sw.full_state_dict(model))
    out.update(flags_ok=all(f == is_frozen(n) for n, f in frozen_flags.items()),
               frozen_grads=sum(p.grad is not None for p in model.parameters() if not p.requires_grad))
    return out


def check_pipeline(zero: int = 0, ckpt: bool = False) -> dict[str, Any]:
    """pp (1f1b, 2 micro-batches) over ``pp`` ranks; with ``zero`` a dp axis of 2 and ZeRO ``zero`` inside
    (0: the bucketed all-reduce). Frozen parameters in no dp bucket, no optimizer state."""
    dp = 2 if torch.distributed.get_world_size() == 4 else 1
    m = mesh(pp=2, dp=dp)
    pipe = sw.pipeline(build(), m, "pp", microbatches=2, schedule="1f1b", loss_fn=lm_loss,
                       dp_axis="dp" if dp > 1 else None, zero_stage=zero, checkpoint=ckpt)
    opt = pipe.build_optimizer(ADAMW)  # over pipe.parameters(): frozen ones included, as a user would pass them
    losses, dp_bytes = [], []
    for s in range(STEPS):
        with CommCounter() as c:
            losses.append(pipe.step(*batch(s)))
        dp_bytes.append(c.bytes("all_reduce", axis="dp") + c.bytes("reduce_scatter", axis="dp"))
        opt.step()
        opt.zero_grad()
    out = compare(losses, sw.full_state_dict(pipe))
    sync = pipe.grad_sync
    in_buckets = [n for g in (sync.groups if sync is not None else []) for n in g.names]
    mine = [p for p in pipe.parameters() if p.requires_grad]
    out.update(frozen_in_buckets=[n for n in in_buckets if is_frozen(n)], dp_bytes=dp_bytes,
               state_numel=_state_numel(opt), trainable_local=sum(p.numel() for p in mine),
               bucket_numel=sum(g.layout.total for g in (sync.groups if sync is not None else [])))
    return out


def check_checkpointed_frozen_inputs() -> dict[str, Any]:
    """Activation checkpointing of every block while the embedding (each block's input's origin) is frozen:
    the blocks' parameters still get gradients, equal to one process without checkpointing (dp over every
    rank)."""
    m = mesh(dp=-1)
    model = sw.DataParallel(build(ckpt=True), m)
    opt = ADAMW([p for p in model.parameters() if p.requires_grad])
    losses = []
    for s in range(STEPS):
        x, y = (local(t, m) for t in batch(s))
        loss = lm_loss(model(x), y)
        loss.backward()
        got = sum(p.grad is not None for p in model.module.parameters() if p.requires_grad)
        opt.step()
        opt.zero_grad()
        losses.append(_mean_loss(loss, m))
    out = compare(losses, {k: v.detach() for k, v in model.module.state_dict().items()})
    out.update(grads=got, trainable=sum(p.requires_grad for p in model.module.parameters()))
    return out


def check_checkpoint(root: str, stage: int) -> dict[str, Any]:
    """ZeRO ``stage`` over every rank, trained two steps, saved whole and without its frozen base
    (``checkpoint/frozen.py``): each frozen tensor written once, then left out; the trainable-only checkpoint
    loads into the same layout and into plain data parallelism built from the base, equal to what was saved."""
    from pathlib import Path

    from shardwise.checkpoint.frozen import FROZEN_STATE, drop_frozen, frozen_keys
    from shardwise.checkpoint.layout import load_model
    from shardwise.checkpoint.sharded import Checkpoint, save_checkpoint
    from shardwise.checkpoint.zero_layout import load_zero, zero_index_state, zero_model_pieces, zero_optimizer_pieces

    m = mesh(dp=-1)
    model, opt = sw.zero(build(), m, stage=stage, optimizer=ADAMW)
    for s in range(2):
        lm_loss(model(local(batch(s)[0], m)), local(batch(s)[1], m)).backward()
        opt.step()
    pieces = zero_model_pieces(model, m) + zero_optimizer_pieces(model, opt, m)
    state = zero_index_state(model)[0]
    whole = Checkpoint(save_checkpoint(Path(root), 1, pieces, mesh=m, state=state, rank_state={}))
    frozen = frozen_keys(model.module)
    written = {k: sum(_piece_numel(p) for p in whole.index["tensors"][f"model/{k}"]["pieces"])
               for k in frozen if f"model/{k}" in whole.index["tensors"]}
    slim = Checkpoint(save_checkpoint(Path(root), 2, drop_frozen(pieces, frozen), mesh=m,
                                      state={**state, FROZEN_STATE: frozen}, rank_state={}))
    trained = sw.full_state_dict(model)
    again, opt2 = sw.zero(build(), m, stage=stage, optimizer=ADAMW)  # built from the same base
    load_zero(slim, again, opt2)
    plain = build()
    load_model(slim, plain, m)
    try:
        slim.full("model/wte.weight")
        missing = "no error"
    except ValueError as exc:
        missing = str(exc)
    numel = dict((k, v.numel()) for k, v in build().state_dict().items())
    return {"frozen": frozen, "written_once": all(written[k] == numel[k] for k in written),
            "aliases_only": sorted(set(frozen) - set(written)),
            "slim_keys": [k for k in slim.keys("model/") if k.removeprefix("model/") in frozen],
            "zero_equal": all(torch.equal(v, trained[k]) for k, v in sw.full_state_dict(again).items()),
            "plain_equal": all(torch.equal(v, trained[k]) for k, v in plain.state_dict().items()),
            "missing": missing}


def _piece_numel(piece: dict[str, Any]) -> int:
    if "range" in piece:
        return int(piece["range"][1])
    n = 1
    for _, size in piece["extent"]:
        n *= size
    return n


def check_zero3_variants() -> dict[str, Any]:
    """ZeRO-3 with the frozen base under bf16 mixed precision (fp32 masters: frozen values exact, trained ones
    close) and with the optimizer offloaded (on CPU ranks the same numbers as without)."""
    from shardwise.parallel.common.mixed_precision import MixedPrecision

    m = mesh(dp=-1)
    out: dict[str, Any] = {}
    for name, kw in (("bf16", {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}),
                     ("offload", {"offload": "optimizer"})):
        model, opt = sw.zero(build(), m, stage=3, optimizer=ADAMW, **kw)
        losses = []
        for s in range(STEPS):
            loss = lm_loss(model(local(batch(s)[0], m)).float(), local(batch(s)[1], m))
            loss.backward()
            opt.step()
            losses.append(_mean_loss(loss, m))
        out[name] = compare(losses, sw.full_state_dict(model))
        out[name]["frozen_master_numel"] = sum(g.master.numel() for g in model.frozen_groups)
        out[name]["frozen_master_grad"] = any(g.master.requires_grad for g in model.frozen_groups)
    return out
