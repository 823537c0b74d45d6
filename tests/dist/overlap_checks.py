"""Rank-side checks for asynchronous tensor parallelism (``parallelize(..., async_tp=True)``; run by
tests/dist/test_async_tp.py).

Three models from the same seed, on the same batch: one device, the plain tensor-parallel model and the
overlapped one. The overlapped model's loss, logits and every gradient equal both (fp32, relative to each
tensor's largest element); and, with the ``ring`` algorithm for the collectives it keeps, it sends exactly the
bytes of the plain model with ring collectives: the overlapped rings move the bytes of the ring all-gathers
and reduce-scatters they replace.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.comm.ops import shard_offsets, shard_sizes
from shardwise.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from shardwise.parallel.tensor import overlap
from shardwise.parallel.tensor.apply_plan import full_tensor, gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
RTOL = 1e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / (1e-12 + b.double().abs().max()))


def _build(kind: str, cfg: dict, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(GPTConfig(**{**TINY, **cfg}))
    from shardwise.models.hf_config import load_hf_config
    from shardwise.models.llama import Llama

    config = dataclasses.replace(load_hf_config(EXAMPLES / "tiny-llama.json"), **cfg)
    return Llama(config, block_size=seq)


def _plan(model: torch.nn.Module, sp: bool) -> dict:
    return gpt_plan(model, sequence_parallel=sp) if isinstance(model, GPT) else \
        model.tensor_parallel_plan(sequence_parallel=sp)


def _step(model: torch.nn.Module, m: sw.Mesh | None, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """One forward + backward: (loss, this rank's logits, {name: full gradient}, bytes sent by this rank)."""
    with CommCounter() as c:
        logits = model(x)
        if m is None:
            loss = lm_loss(logits, y)
        else:
            loss = vocab_parallel_cross_entropy(logits, y, mesh=m, axis="tp")
        loss.backward()
    grads = {n: (p.grad if m is None else full_tensor(p, p.grad)).detach().clone()
             for n, p in model.named_parameters()}
    return loss.detach(), logits.detach(), grads, c


def check_async_parity(tp: int, kind: str, sp: bool, seq: int, cfg: dict | None = None,
                       algorithms: tuple[str, ...] = ("native", "ring")) -> dict:
    """Plain vs overlapped vs one device (one SGD-free step: loss, logits, all gradients) for every collective
    ``algorithm`` in ``algorithms``; with ``ring``, the bytes this rank sends under both paths. Returns
    {"err": worst relative error, "bytes": {algorithm: (plain, overlapped)}, "async": overlapped collective
    records by op}."""
    m = mesh(tp=tp)
    cfg = cfg or {}
    batch = 2
    gen = torch.Generator().manual_seed(1)
    ref = _build(kind, cfg, seq)
    x, y = synthetic_batch(batch, seq, ref.config.vocab_size, gen)
    ref_loss, ref_logits, ref_grads, _ = _step(ref, None, x, y)
    n, c = m.size("tp"), m.coord("tp")
    v = ref_logits.size(-1)
    v0, vr = shard_offsets(v, n)[c], shard_sizes(v, n)[c]
    err, sent, recs = 0.0, {}, {}
    for algorithm in algorithms:
        out = {}
        for async_tp in (False, True):
            model = _build(kind, cfg, seq)
            model = sw.parallelize(model, m, _plan(model, sp), axis="tp", sequence_parallel=sp,
                                   algorithm=algorithm, async_tp=async_tp)
            out[async_tp] = _step(model, m, x, y)
        (pl, plog, pg, pc), (al, alog, ag, ac) = out[False], out[True]
        assert alog.shape == (batch, seq, vr), alog.shape
        pairs = [(al, pl), (al, ref_loss), (alog, plog), (alog, ref_logits[..., v0:v0 + vr])]
        pairs += [(ag[k], pg[k]) for k in pg] + [(ag[k], ref_grads[k]) for k in ref_grads]
        assert list(ag) == list(ref_grads)
        for a, b in pairs:
            e = _rel(a, b)
            assert e < RTOL, (algorithm, e, a.shape)
            err = max(err, e)
        sent[algorithm] = (pc.bytes_sent, ac.bytes_sent)
        recs[algorithm] = {op: sum(1 for r in ac.records if r.op == op and r.algorithm.startswith("async-"))
                           for op in ("all_gather", "reduce_scatter", "all_reduce")}
    return {"err": err, "bytes": sent, "async": recs}


def check_functions(tp: int, seq: int) -> dict:
    """The four overlapped functions against their unoverlapped compositions on random fp32 inputs (values and
    gradients; uneven sequence chunks when ``seq`` % tp), with the messages each ring sends. Returns
    {name: (messages sent, bytes sent)} of this rank."""
    from shardwise.comm import autograd as cag

    m = mesh(tp=tp)
    n, c = m.size("tp"), m.coord("tp")
    sizes = shard_sizes(seq, n)
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(2, seq, 12, generator=gen, dtype=torch.float64)
    w = torch.randn(6, 12, generator=gen, dtype=torch.float64)  # this rank's (o_r, i) or (o, i_r): same draw
    w = w + c  # a different shard per rank
    b = torch.randn(6, generator=gen, dtype=torch.float64)
    chunk = full[:, shard_offsets(seq, n)[c]:shard_offsets(seq, n)[c] + sizes[c]]
    counts = {}

    def run(fn, inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        outs = fn(*leaves)
        outs = outs if isinstance(outs, tuple) else (outs,)
        loss = sum((o * torch.linspace(-1, 1, o.numel(), dtype=o.dtype).view_as(o)).sum() for o in outs)
        loss.backward()
        return [o.detach() for o in outs], [t.grad for t in leaves]

    cases = {
        "gather_linear": (
            lambda x, w_, b_: overlap.gather_linear(x, w_, b_, m, "tp", sizes=sizes),
            lambda x, w_, b_: (lambda g: (torch.nn.functional.linear(g, w_, b_), g))(
                cag.allgather_reducescatter(x, m, "tp", dim=1, sizes=sizes)),
            [chunk, w, b]),
        "linear_scatter": (
            lambda x, w_: overlap.linear_scatter(x, w_, m, "tp"),
            lambda x, w_: cag.reducescatter_allgather(torch.nn.functional.linear(x, w_), m, "tp", dim=1),
            [full, w]),
        # a transposed weight (Conv1D's (in, out) storage): the layers pass a non-contiguous w.t() view
        "gather_linear_transposed": (
            lambda x, wt: overlap.gather_linear(x, wt.t(), None, m, "tp", sizes=sizes),
            lambda x, wt: (lambda g: (torch.nn.functional.linear(g, wt.t()), g))(
                cag.allgather_reducescatter(x, m, "tp", dim=1, sizes=sizes)),
            [chunk, w.t().contiguous()]),
        "linear_scatter_transposed": (
            lambda x, wt: overlap.linear_scatter(x, wt.t(), m, "tp"),
            lambda x, wt: cag.reducescatter_allgather(torch.nn.functional.linear(x, wt.t()), m, "tp", dim=1),
            [full, w.t().contiguous()]),
        "linear_allreduce": (
            lambda x, w_: overlap.linear_allreduce(x, w_, m, "tp"),
            lambda x, w_: cag.allreduce_identity(torch.nn.functional.linear(x, w_), m, "tp"),
            [full, w]),
        "allreduce_grad_linear": (
            lambda x, w_, b_: overlap.allreduce_grad_linear(x, w_, b_, m, "tp"),
            lambda x, w_, b_: (lambda g: (torch.nn.functional.linear(g, w_, b_), g))(
                cag.identity_allreduce(x, m, "tp")),
            [full, w, b]),
    }
    for name, (fast, slow, inputs) in cases.items():
        with CommCounter() as cnt:
            fo, fg = run(fast, inputs)
        so, sg = run(slow, inputs)
        for a, e in zip(fo + fg, so + sg):
            torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=lambda s, name=name: f"{name}: {s}")
        counts[name] = (cnt.messages_sent, cnt.bytes_sent)
        # under bf16 autocast (fp32 inputs): the same dtypes as the unoverlapped path, values to bf16 precision
        fp32 = [t.float() for t in inputs]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            fo, fg = run(fast, fp32)
            so, sg = run(slow, fp32)
        for a, e in zip(fo + fg, so + sg):
            assert a.dtype == e.dtype and a.shape == e.shape, (name, a.dtype, e.dtype)
            assert _rel(a, e) < 2e-2, (name, _rel(a, e))
    return counts


def check_bad_flag() -> str:
    """``async_tp`` must be a bool: a one-line TypeError before anything is sharded or sent."""
    m = mesh(tp=2)
    model = _build("gpt", {}, 16)
    with CommCounter() as c:
        try:
            sw.parallelize(model, m, gpt_plan(model), axis="tp", async_tp="yes")  # type: ignore[arg-type]
        except TypeError as e:
            msg = str(e)
        else:
            raise AssertionError("async_tp='yes' accepted")
    assert not c.records and type(model.blocks[0].attn.qkv) is torch.nn.Linear  # nothing changed or sent
    return msg
