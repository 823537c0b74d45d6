"""Rank-side checks for tensor parallelism (run inside LocalWorld ranks by tests/dist/test_tensor_parallel.py).

The reference is always the single-device GPT built from the same seed and trained on the same (full) batch
in the same process; the parallel model is compared through ``sw.full_state_dict`` under the plain keys.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig, lm_loss, synthetic_batch
from shardwise.parallel.tensor.apply_plan import gpt_plan, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh
from tests.dist.reference import sgd_reference

TINY = dict(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64)


def _batches(cfg: GPTConfig, batch: int, seq: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [synthetic_batch(batch, seq, cfg.vocab_size, gen) for _ in range(steps)]


def _reference(cfg: GPTConfig, batches, lr: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    return sgd_reference(GPT(cfg), batches, lr)


def _parallel(cfg: GPTConfig, m: sw.Mesh, sp: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    model = sw.parallelize(GPT(cfg), m, gpt_plan(cfg, sequence_parallel=sp), axis="tp", sequence_parallel=sp)
    return sw.DataParallel(model, m, axis="dp") if "dp" in m.axes else model


def check_training_parity(axes: dict[str, int], cfg_kw: dict, sp: bool, steps: int = 5, batch: int = 4,
                          seq: int = 16, lr: float = 0.5) -> list[float]:
    """Train the parallel GPT (SGD) and the single-device one on the same batches: losses and parameters
    agree to fp32 rtol 1e-5 at every step. Returns the parallel losses."""
    m = mesh(**axes)
    cfg = GPTConfig(**{**TINY, **cfg_kw})
    batches = _batches(cfg, batch, seq, steps)
    ref_losses, ref_state = _reference(cfg, batches, lr)
    model = _parallel(cfg, m, sp)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp, c = (m.size("dp"), m.coord("dp")) if "dp" in m.axes else (1, 0)
    per = batch // dp
    losses = []
    for x, y in batches:
        x, y = x[c * per:(c + 1) * per], y[c * per:(c + 1) * per]
        opt.zero_grad()
        loss = vocab_parallel_cross_entropy(model(x), y, mesh=m, axis="tp")
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if dp > 1:
            sw.comm.all_reduce(total, m, "dp", op="avg")
        losses.append(total.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    full = sw.full_state_dict(model)
    assert list(full) == list(ref_state), (list(full), list(ref_state))
    for k, v in ref_state.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")
    assert len(set(ref_losses)) == len(ref_losses), ref_losses  # parameters moved: not a trivial agreement
    return losses


def check_comm_counts(sp: bool, cfg_kw: dict | None = None) -> tuple[dict[str, int], dict[str, int], list[int]]:
    """Collectives of one forward (+ loss) and one backward of the tp=2 GPT, by op (tp axis only), and the
    bytes of each backward all-reduce in call order."""
    m = mesh(tp=2)
    cfg = GPTConfig(**{**TINY, **(cfg_kw or {})})
    model = _parallel(cfg, m, sp)
    x, y = _batches(cfg, 2, 16, 1)[0]
    with CommCounter() as fwd:
        loss = vocab_parallel_cross_entropy(model(x), y, mesh=m, axis="tp")
    with CommCounter() as bwd:
        loss.backward()
    assert all(r.axis == "tp" for r in fwd.records + bwd.records)
    return fwd.by_op(), bwd.by_op(), [r.nbytes for r in bwd.records if r.op == "all_reduce"]


def check_vocab_ce(vocab: int, n_rows: int = 12) -> float:
    """vocab_parallel_cross_entropy == F.cross_entropy of the full logits: value and gradient (with ignored
    targets, mean and sum), on uneven vocabulary splits. Returns the loss."""
    m = mesh(tp=-1)
    gen = torch.Generator().manual_seed(3)
    full = torch.randn(n_rows, vocab, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, vocab, (n_rows,), generator=gen)
    targets[::5] = -100
    sizes = sw.comm.ops.shard_sizes(vocab, m.size("tp"))
    start = sum(sizes[:m.coord("tp")])
    for reduction in ("mean", "sum"):
        ref_in = full.clone().requires_grad_()
        ref = F.cross_entropy(ref_in, targets, reduction=reduction)
        ref.backward()
        local = full[:, start:start + sizes[m.coord("tp")]].clone().requires_grad_()
        with CommCounter() as c:
            loss = vocab_parallel_cross_entropy(local, targets, mesh=m, axis="tp", vocab_size=vocab,
                                                reduction=reduction)
            loss.backward()
        assert c.by_op() == {"all_reduce": 2}, c.by_op()  # max, then (sum-exp, target logit); none backward
        torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(local.grad, ref_in.grad[:, start:start + local.size(1)], rtol=1e-10, atol=1e-12)
    return float(loss)


def _digest(t: torch.Tensor) -> int:
    return zlib.crc32(t.detach().contiguous().numpy().tobytes())


def check_rng_streams(sp: bool) -> dict[str, int]:
    """Digests per rank of: the embedding dropout output, a residual dropout output, draws inside the
    column→row region, and the shared stream after forward (the parent compares across tp ranks)."""
    m = mesh(tp=2)
    cfg = GPTConfig(**{**TINY, "dropout": 0.3})
    torch.manual_seed(0)
    model = _parallel(cfg, m, sp)
    seen: dict[str, int] = {}
    model.drop.register_forward_hook(lambda _m, _i, out: seen.__setitem__("embed_drop", _digest(out == 0)))
    model.blocks[0].attn.resid_drop.register_forward_hook(
        lambda _m, _i, out: seen.__setitem__("resid_drop", _digest(out == 0)))
    model.blocks[0].attn.qkv.register_forward_hook(
        lambda *_: seen.__setitem__("head_region", _digest(torch.rand(16))))
    torch.manual_seed(123)  # the shared stream: same seed on every tp rank
    x, y = _batches(cfg, 2, 16, 1)[0]
    out = model(x)
    vocab_parallel_cross_entropy(out, y, mesh=m, axis="tp").backward()
    seen["after_forward"] = _digest(torch.rand(16))
    return seen


def check_checkpoint_dropout(sp: bool) -> float:
    """With dropout > 0, activation checkpointing replays the same split-region masks: gradients equal the
    un-checkpointed model's. Returns the loss."""
    from shardwise.parallel.common.activation_checkpointing import checkpoint_layers

    m = mesh(tp=2)
    cfg = GPTConfig(**{**TINY, "dropout": 0.2})
    x, y = _batches(cfg, 2, 16, 1)[0]
    grads, losses = [], []
    for ckpt in (False, True):
        model = _parallel(cfg, m, sp)
        if ckpt:
            checkpoint_layers(model)
        torch.manual_seed(7)
        loss = vocab_parallel_cross_entropy(model(x), y, mesh=m, axis="tp")
        loss.backward()
        losses.append(loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
    assert losses[0] == losses[1], losses
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    return losses[0]


def check_bad_input() -> list[str]:
    """Each bad call raises before any collective and leaves the model usable. Returns the messages."""
    m = mesh(tp=2)
    cfg = GPTConfig(**TINY)
    msgs = []

    def expect(fn, exc=ValueError) -> None:
        with CommCounter() as c:
            try:
                fn()
            except exc as e:
                msgs.append(str(e))
            else:
                raise AssertionError(f"no {exc.__name__} from {fn}")
        assert not c.records, c.records

    expect(lambda: sw.parallelize(GPT(cfg), m, {"blocks.*.mlp.nope": sw.ColumnParallel()}))
    expect(lambda: sw.parallelize(GPT(cfg), m, {"ln_f": sw.ColumnParallel()}))
    expect(lambda: sw.parallelize(GPT(cfg), m, {"blocks.*.attn": sw.RowParallel()}))
    odd = GPTConfig(**{**TINY, "n_head": 3, "n_embd": 48})
    expect(lambda: sw.parallelize(GPT(odd), m, gpt_plan(odd)))                         # 3 heads over tp=2
    expect(lambda: sw.parallelize(GPT(cfg), m, {"wte": sw.VocabParallel()}))           # tied head left whole
    expect(lambda: sw.parallelize(GPT(cfg), m, gpt_plan(cfg), sequence_parallel=True))  # norms uncovered
    expect(lambda: sw.parallelize(GPT(cfg), m, gpt_plan(cfg, sequence_parallel=True)))  # SP styles without SP
    expect(lambda: sw.parallelize(GPT(cfg), m, gpt_plan(cfg), axis="dp"))              # unknown axis
    expect(lambda: sw.parallelize(GPT(cfg), m, {"wte": "column"}), TypeError)
    done = sw.parallelize(GPT(cfg), m, gpt_plan(cfg))
    expect(lambda: sw.parallelize(done, m, gpt_plan(cfg)))                             # already parallelized
    x, y = _batches(cfg, 2, 8, 1)[0]
    logits = done(x)
    expect(lambda: vocab_parallel_cross_entropy(logits[:, :, :3], y, mesh=m, axis="tp", vocab_size=256))
    return msgs
