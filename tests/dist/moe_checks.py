"""Rank-side checks of expert parallelism at the library level (run by tests/dist/test_moe.py): a GPT with MoE
layers, its experts cut over an ``ep`` axis folded into the data-parallel ranks (``shard_experts``), dense
parameters averaged by ``DataParallel`` over dp, expert gradients by ``ExpertGradSync`` over the ranks that hold
the same experts. Compared with the same model on one process over the whole batch (same seed, same data)."""

from __future__ import annotations

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import GPT, GPTConfig
from shardwise.models.moe_balance import dp_reducer, step_stats, update_bias
from shardwise.parallel.data.data_parallel import DataParallel
from shardwise.parallel.expert.grads import ExpertGradSync
from shardwise.parallel.expert.shard import expert_params, shard_experts
from tests.dist.meshes import mesh

STEPS, B, T = 2, 4, 16


def _config(**kw: object) -> GPTConfig:
    base = dict(vocab_size=64, block_size=T, n_layer=2, n_head=2, n_embd=32, n_experts=4, top_k=2, moe_ffn=32,
                n_shared_experts=1, moe_aux_loss_coef=0.05)
    return GPTConfig(**{**base, **kw})  # type: ignore[arg-type]


def _data(step: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, vocab, (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(model: torch.nn.Module, step_fn, params, shard: slice, cfg: GPTConfig, after=None) -> list[float]:
    opt = torch.optim.AdamW(params, lr=1e-2, eps=1e-5)
    losses = []
    for s in range(STEPS):
        x, y = _data(s, cfg.vocab_size)
        logits = model(x[shard])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y[shard].reshape(-1))
        loss.backward()
        step_fn()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after:
            after()
        losses.append(loss.item())
    return losses


def check_ep(ep: int, cfg_kw: dict) -> dict:
    """dp = world ranks, experts over ``ep`` of them; returns the max relative error of the expert and dense
    parameters after STEPS AdamW steps against one process, and the all-to-all counts of one forward."""
    m = mesh(dp=-1)
    dp = m.size("dp")
    em = mesh(edp=dp // ep, ep=ep)
    cfg = _config(**cfg_kw)
    torch.manual_seed(0)
    ref = GPT(cfg)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(cfg)
    shard_experts(model, em, "ep")
    wrapped = DataParallel(model, m, "dp")
    experts = ExpertGradSync(expert_params(model), em, "edp", dp)
    reduce = dp_reducer(m, "dp")
    rows = slice(m.coord("dp") * (B // dp), (m.coord("dp") + 1) * (B // dp))
    losses = _train(wrapped, experts.sync, list(model.parameters()), rows, cfg,
                    after=lambda: update_bias(model, reduce) or step_stats(model, reduce))
    ref_losses = _train(ref, lambda: None, list(ref.parameters()), slice(0, B), cfg,
                        after=lambda: update_bias(ref) or step_stats(ref))
    err = 0.0
    full = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        want = full[name]
        if p.dim() == 3 and p.size(0) != want.size(0):
            want = want[em.coord("ep") * p.size(0):(em.coord("ep") + 1) * p.size(0)]
        err = max(err, float((p - want).abs().max() / want.abs().max().clamp_min(1e-12)))
    for name, b in model.named_buffers():
        err = max(err, float((b - dict(ref.named_buffers())[name]).abs().max()))
    with CommCounter() as counter:
        with torch.no_grad():
            model(_data(0, cfg.vocab_size)[0][rows])
    return {"err": err, "losses": losses, "ref": ref_losses, "ops": counter.by_op(),
            "a2a_bytes": counter.bytes("all_to_all")}
