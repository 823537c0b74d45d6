"""``shardwise bench pp --hf llama``: a third-party decoder (Hugging Face ``transformers``, built from a config,
no download) pipelined by ``sw.pipeline(..., example_inputs=...)`` vs ``torch.distributed.pipelining``'s own
graph frontend (``pipeline(module, mb_kwargs=..., split_spec=...)``, which captures with ``torch.export``) on the
same split and schedule. Both compute the same causal-LM loss on the last stage with ``loss_fn(logits, ids)``
(torch's runtime feeds the step's arguments to stage 0 only, so the model cannot take ``labels=`` there, whose
loss would run on the last stage); a step is forward + backward over the micro-batches and ``zero_grad``. Rounds alternate the order of the two sides; the ratio is the median over
rounds of ours / torch's median step (``harness.paired_ratio``).
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any, Callable

import torch

__all__ = ["run_hf"]

Step = Callable[[torch.Tensor], float]


def _model(args: argparse.Namespace) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=1024, hidden_size=args.hf_hidden, intermediate_size=args.hf_hidden * 8 // 3,
                  num_hidden_layers=args.layers or 4, num_attention_heads=8, num_key_value_heads=4,
                  max_position_embeddings=max(args.seq, 64), use_cache=False)
    if args.hf == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, tie_word_embeddings=False))
    return tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=False))


def _ours(args: argparse.Namespace, mesh: Any, schedule: str, split: list[str], ex: torch.Tensor) -> Step:
    import shardwise as sw

    pipe = sw.pipeline(_model(args), mesh, "pp", microbatches=args.microbatches, schedule=schedule, split=split,
                       example_inputs={"input_ids": ex}, loss_fn=causal_lm_loss, transport=args.transport)

    def step(ids: torch.Tensor) -> float:
        loss = pipe.step(ids, input_ids=ids)
        pipe.zero_grad(set_to_none=True)
        return loss
    return step


def _torch(args: argparse.Namespace, mesh: Any, schedule: str, split: list[str], ex: torch.Tensor) -> Step:
    from torch.distributed import pipelining

    model = _model(args)
    pipe = pipelining.pipeline(model, mb_args=(), mb_kwargs={"input_ids": ex},
                               split_spec={name: pipelining.SplitPoint.BEGINNING for name in split})
    me, p = mesh.coord("pp"), mesh.size("pp")
    stage = pipe.build_stage(me, mesh.device, group=mesh.group("pp"))
    cls = pipelining.ScheduleGPipe if schedule == "gpipe" else pipelining.Schedule1F1B
    sched = cls(stage, n_microbatches=args.microbatches, loss_fn=causal_lm_loss)

    def step(ids: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        if me == 0:
            sched.step(input_ids=ids)
        elif me == p - 1:
            sched.step(target=ids, losses=losses)
        else:
            sched.step()
        stage.submod.zero_grad(set_to_none=True)
        return float(torch.stack(losses).mean()) if losses else float("nan")
    return step


def causal_lm_loss(out: Any, ids: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of a causal LM's logits (the model output's ``logits``, or its first element)."""
    logits = out if isinstance(out, torch.Tensor) else out.logits if hasattr(out, "logits") else out[0]
    v = logits.size(-1)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, v).float(), ids[:, 1:].reshape(-1))


def _times(step: Step, ids: torch.Tensor, count: int) -> list[float]:
    """Seconds of ``count`` steps on ``ids`` (``steps.time_steps``, which takes ``step(x, y)``)."""
    from .steps import time_steps
    return time_steps(lambda x, _y: step(x), [(ids, ids)], count)


def run_hf(args: argparse.Namespace) -> int:
    """One rank of the comparison (inside ``shardwise bench pp --hf ...``)."""
    import shardwise as sw

    from .harness import paired_ratio, write_json
    from .steps import set_bench_threads

    world = sw.init()
    mesh = sw.Mesh(pp=-1)
    set_bench_threads(args.threads, world.world_size)
    layers, p = args.layers or 4, mesh.size("pp")
    split = [f"model.layers.{layers * k // p}" for k in range(1, p)]
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=gen)
    ex = ids[: args.batch // args.microbatches].clone()
    rows = []
    for schedule in [s for s in args.schedules.split(",") if s in ("gpipe", "1f1b")]:
        sides = {"ours": _ours(args, mesh, schedule, split, ex), "torch": _torch(args, mesh, schedule, split, ex)}
        loss = {k: s(ids) for k, s in sides.items()}
        for s in sides.values():
            _times(s, ids, args.warmup)
        rounds: dict[str, list[list[float]]] = {"ours": [], "torch": []}
        for r in range(args.repeats):
            for name in (["ours", "torch"] if r % 2 == 0 else ["torch", "ours"]):
                sw.comm.barrier(mesh, "pp")
                rounds[name].append(_times(sides[name], ids, args.steps))
        rows.append({"schedule": schedule, "split": split, "loss": loss,
                     "ours_ms": 1e3 * statistics.median(t for r in rounds["ours"] for t in r),
                     "torch_ms": 1e3 * statistics.median(t for r in rounds["torch"] for t in r),
                     "ratio": paired_ratio(rounds["ours"], rounds["torch"])})
    if world.rank == world.world_size - 1:  # the last stage knows both losses
        print(f"{args.hf} decoder, {layers} layers, hidden {args.hf_hidden}, batch {args.batch} x seq {args.seq}, "
              f"m={args.microbatches}, {p} ranks, split {split}")
        for row in rows:
            print(f"  {row['schedule']:6s} ours {row['ours_ms']:8.1f} ms   torch.distributed.pipelining "
                  f"{row['torch_ms']:8.1f} ms   ours/torch {row['ratio']:.3f}   loss ours {row['loss']['ours']:.5f}"
                  f" torch {row['loss']['torch']:.5f}")
        if args.json:
            write_json(args.json, rows)
    sw.shutdown()
    return 0
