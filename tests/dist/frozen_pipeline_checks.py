"""Rank-side checks for frozen parameters sharded by ZeRO-3 inside pipelines (pp 2 x dp 2), run by
tests/dist/test_frozen.py inside LocalWorld ranks.

The model and the one-process reference are tests/dist/frozen_checks.py's: the reference GPT with a frozen base
(tied embedding, position embedding, attention ``qkv``/``proj.weight``, all of block 1), AdamW over the trainable
parameters on the whole batch. Each check also returns what the rank holds and sends for the frozen part, read
from the groups and the communication counter, for the test to compare with what the model's shapes imply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import lm_loss
from tests.dist import frozen_checks as fc
from tests.dist.meshes import mesh


def _pipe(schedule: str = "1f1b", chunks: int = 1, ckpt: bool = False, seed: int = 0) -> Any:
    m = mesh(pp=2, dp=2)
    # interleaved: pp rank 0 runs stages 0 and 2, rank 1 stage 1 (block 1, frozen whole) and stage 3 (the tied head)
    split = ["blocks.1", "blocks.2", "ln_f"] if chunks == 2 else None
    return m, sw.pipeline(fc.build(seed), m, "pp", microbatches=2, schedule=schedule, chunks=chunks, split=split,
                          loss_fn=lm_loss, dp_axis="dp", zero_stage=3, checkpoint=ckpt)


def _watch_frozen(pipe: Any) -> list[int]:
    """After every gather of a frozen group: the frozen elements gathered on this rank at that moment."""
    seen: list[int] = []
    groups = pipe.zero3.frozen_groups
    for g in groups:
        def finish(handle: Any, _orig: Any = g.finish_gather) -> None:
            _orig(handle)
            seen.append(sum(f.layout.total for f in groups if f.gathered))
        g.finish_gather = finish
    return seen


def _units(pipe: Any) -> list[dict[str, Any]]:
    """Per unit of this rank (stage, index): its trainable and frozen group sizes and this rank's shard of each."""
    out = []
    for (s, k), u in pipe.zero3.groups.items():
        t, f = u.trainable, u.frozen
        out.append({"key": [s, k], "name": pipe.stages[s].units[k].name,
                    "t_total": t.layout.total if t else 0, "t_shard": (t.hi - t.lo) if t else 0,
                    "f_total": f.layout.total if f else 0, "f_shard": (f.hi - f.lo) if f else 0})
    return out


def check_pipeline_zero3(schedule: str = "1f1b", chunks: int = 1, ckpt: bool = False) -> dict[str, Any]:
    """ZeRO-3 inside the pipeline with the frozen base: parity with one process, the frozen tensors unchanged,
    nothing of the frozen base whole between steps, per-step all-gather and reduce-scatter bytes over dp, and an
    evaluation (forward only) after training."""
    m, pipe = _pipe(schedule, chunks, ckpt)
    opt = pipe.build_optimizer(fc.ADAMW)
    resident = _watch_frozen(pipe)
    losses, ag, rs, held_between = [], [], [], []
    for s in range(fc.STEPS):
        with CommCounter() as c:
            losses.append(pipe.step(*fc.batch(s)))
        ag.append(c.bytes("all_gather", axis="dp"))
        rs.append(c.bytes("reduce_scatter", axis="dp"))
        opt.step()
        opt.zero_grad()
        held_between.append(sum(q.numel() for q in pipe.parameters() if not q.requires_grad))
    evaluated = pipe.evaluate(*fc.batch(0))
    max_resident = max(resident, default=0)  # training and evaluation; full_state_dict below gathers everything
    out = fc.compare(losses, sw.full_state_dict(pipe))  # collective over dp: gathers every group once
    ref_model = fc.build()  # the evaluation against one process with the reference's trained weights
    ref_model.load_state_dict(fc.reference()[1])
    with torch.no_grad():
        ref_eval = float(lm_loss(ref_model(fc.batch(0)[0]), fc.batch(0)[1]))
    z = pipe.zero3
    out.update(units=_units(pipe), held_frozen=[g.layout.total for g in z.held if g in z.frozen_groups],
               held_frozen_shard=[g.hi - g.lo for g in z.held if g in z.frozen_groups],
               held_trainable_shard=[g.hi - g.lo for g in z.held if g not in z.frozen_groups],
               ag_bytes=ag, rs_bytes=rs, bucket_numel=sum(g.layout.total for g in pipe.grad_sync.groups),
               frozen_in_buckets=[n for g in pipe.grad_sync.groups for n in g.names if fc.is_frozen(n)],
               held_between=held_between, max_resident=max_resident,
               frozen_master_grad=any(g.master.requires_grad for g in z.frozen_groups),
               frozen_in_optimizer=any(g.master in opt.optimizer.state for g in z.frozen_groups),
               state_numel=fc._state_numel(opt), shard_numel=sum(g.hi - g.lo for g in pipe.grad_sync.groups),
               eval_err=abs(evaluated - ref_eval) / abs(ref_eval), pp=m.coord("pp"), dp=m.coord("dp"),
               m=pipe.microbatches, stages=sorted(pipe.stages))
    return out


def _save(root: Path, step: int, pipe: Any, opt: Any, m: sw.Mesh, slim: bool) -> Any:
    from shardwise.checkpoint.frozen import FROZEN_STATE, drop_frozen, frozen_keys
    from shardwise.checkpoint.layout import tied_aliases
    from shardwise.checkpoint.pipeline_zero import pipeline_zero_groups, pipeline_zero_pieces
    from shardwise.checkpoint.pipeline_zero3 import zero3_model_pieces
    from shardwise.checkpoint.sharded import Checkpoint, save_checkpoint

    pieces = zero3_model_pieces(pipe) + pipeline_zero_pieces(pipe, opt)
    state: dict[str, Any] = {"aliases": tied_aliases(pipe.model), "pipeline_zero_groups": True}
    if slim:  # train.save_frozen = false: what runtime/frozen_base.py does with a strategy's pieces
        state[FROZEN_STATE] = frozen_keys(pipe.model)
        pieces = drop_frozen(pieces, state[FROZEN_STATE])
    return Checkpoint(save_checkpoint(root, step, pieces, mesh=m, state=state,
                                      rank_state={"zero_groups": pipeline_zero_groups(pipe)}))


def check_pipeline_zero3_checkpoint(root: str) -> dict[str, Any]:
    """Train two steps, save whole and without the frozen base; load the whole one into a pipeline built from
    other weights (every value must come from the file) and the slim one into a pipeline built from the same base;
    both equal what was saved, and a next step on each equals the next step of the original. The whole checkpoint
    also loads into one process (the plain model)."""
    from shardwise.checkpoint.layout import load_model
    from shardwise.checkpoint.pipeline_zero import load_pipeline_zero

    m, pipe = _pipe()
    opt = pipe.build_optimizer(fc.ADAMW)
    for s in range(2):
        pipe.step(*fc.batch(s))
        opt.step()
        opt.zero_grad()
    whole = _save(Path(root), 1, pipe, opt, m, slim=False)
    slim = _save(Path(root), 2, pipe, opt, m, slim=True)
    trained = sw.full_state_dict(pipe)
    numel = {k: v.numel() for k, v in fc.build().state_dict().items()}
    written = {k[len("model/"):]: sum(fc._piece_numel(p) for p in info["pieces"])
               for k, info in whole.index["tensors"].items() if k.startswith("model/")}
    loaded = {}
    for name, ckpt, seed in (("whole", whole, 1), ("slim", slim, 0)):
        _, again = _pipe(seed=seed)
        again_opt = again.build_optimizer(fc.ADAMW)
        load_pipeline_zero(ckpt, again, again_opt)
        loaded[name] = (again, again_opt)
    out = {name: all(torch.equal(v, trained[k]) for k, v in sw.full_state_dict(p).items())
           for name, (p, _) in loaded.items()}
    plain = fc.build(seed=1)
    load_model(whole, plain, m)
    out["plain"] = all(torch.equal(v, trained[k]) for k, v in plain.state_dict().items())
    out["written_once"] = all(written[k] == numel[k] for k in written)
    out["frozen_written"] = sorted(k for k in written if fc.is_frozen(k))
    out["slim_frozen"] = sorted(k[len("model/"):] for k in slim.keys("model/") if fc.is_frozen(k[len("model/"):]))
    nxt = [pipe.step(*fc.batch(2)), *(p.step(*fc.batch(2)) for p, _ in loaded.values())]
    out["next_losses"] = nxt
    opt.step()
    for p, o in loaded.values():
        o.step()
    after = sw.full_state_dict(pipe)
    out["next_equal"] = [all(torch.equal(v, after[k]) for k, v in sw.full_state_dict(p).items())
                         for p, _ in loaded.values()]
    return out


def check_pipeline_zero3_bf16(root: str) -> dict[str, Any]:
    """ZeRO-3 inside the pipeline under bf16 mixed precision with the frozen base: bf16 compute shards, fp32
    masters that ``full_state_dict`` returns (the frozen ones exact), losses close to one process's fp32; a
    checkpoint without the frozen base loads (masters from the file, frozen groups kept) into a pipeline built
    from the same base, equal to what was saved."""
    from shardwise.checkpoint.pipeline_zero import load_pipeline_zero

    m = mesh(pp=2, dp=2)

    def build() -> Any:
        return sw.pipeline(fc.build(), m, "pp", microbatches=2, schedule="1f1b", dp_axis="dp", zero_stage=3,
                           loss_fn=lambda out, y: lm_loss(out.float(), y), mixed_precision=sw.MixedPrecision())
    pipe = build()
    opt = pipe.build_optimizer(fc.ADAMW)
    full, out = _trained(pipe, opt)
    z = pipe.zero3
    slim = _save(Path(root), 1, pipe, opt, m, slim=True)
    again = build()
    load_pipeline_zero(slim, again, again.build_optimizer(fc.ADAMW))
    out.update(full_dtypes=sorted({str(v.dtype) for v in full.values()}),
               frozen_compute=sorted({str(g.full.dtype) for g in z.frozen_groups}),
               frozen_master=sorted({str(g.master.dtype) for g in z.frozen_groups}),
               frozen_shard_numel=sum(g.hi - g.lo for g in z.frozen_groups),
               frozen_total=sum(g.layout.total for g in z.frozen_groups),
               held_between=sum(q.numel() for q in pipe.parameters() if not q.requires_grad),
               reloaded=all(torch.equal(v, full[k]) for k, v in sw.full_state_dict(again).items()))
    return out


def _trained(pipe: Any, opt: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``fc.STEPS`` steps of ``pipe``; its full state and the comparison with one process."""
    losses = []
    for s in range(fc.STEPS):
        losses.append(pipe.step(*fc.batch(s)))
        opt.step()
        opt.zero_grad()
    full = sw.full_state_dict(pipe)
    return full, fc.compare(losses, full)


def check_pipeline_zero3_tp(root: str) -> dict[str, Any]:
    """pp 2 x dp 2 x tp 2 (8 ranks): each tp coordinate's frozen pieces sharded over dp; parity with one process;
    the checkpoint (each unit gathered over dp for the save, as with tp inside) loads back into a pipeline built
    from other weights, equal to what was saved."""
    import functools

    from shardwise.checkpoint.pipeline_zero import load_pipeline_zero
    from shardwise.parallel.tensor.apply_plan import gpt_plan, vocab_parallel_cross_entropy

    m = mesh(pp=2, dp=2, tp=2)

    def build(seed: int) -> Any:
        model = sw.parallelize(fc.build(seed), m, gpt_plan(fc.CFG), axis="tp")
        return sw.pipeline(model, m, "pp", microbatches=2, schedule="1f1b", dp_axis="dp", zero_stage=3,
                           loss_fn=functools.partial(vocab_parallel_cross_entropy, mesh=m, axis="tp"))
    pipe = build(0)
    opt = pipe.build_optimizer(fc.ADAMW)
    full, out = _trained(pipe, opt)
    z = pipe.zero3
    ckpt = _save(Path(root), 1, pipe, opt, m, slim=False)
    again = build(1)
    load_pipeline_zero(ckpt, again, again.build_optimizer(fc.ADAMW))
    out.update(frozen_shard=sum(g.hi - g.lo for g in z.frozen_groups), frozen_total=sum(g.layout.total
                                                                                         for g in z.frozen_groups),
               held_between=sum(q.numel() for q in pipe.parameters() if not q.requires_grad),
               reloaded=all(torch.equal(v, full[k]) for k, v in sw.full_state_dict(again).items()))
    return out
