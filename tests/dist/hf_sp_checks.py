"""Rank-side checks for the Llama family under tensor parallelism with sequence parallelism (run by
tests/dist/test_hf_sequence_parallel.py). The norms and residuals hold S(seq) over tp, the q/k/v projections
gather the sequence and the attention rotates the gathered q/k by their positions. Reference: the single-device
decoder of the same seed on the same batches, in the same process (fp32)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.comm.ops import shard_offsets
from shardwise.models.gpt import lm_loss
from shardwise.models.hf_config import load_hf_config
from shardwise.models.llama import Llama
from shardwise.parallel.common.activation_checkpointing import checkpoint_layers
from shardwise.parallel.tensor.apply_plan import full_tensor, vocab_parallel_cross_entropy
from tests.dist.meshes import mesh

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"


def _model(example: str, tied: bool | None, block: int) -> Llama:
    config = load_hf_config(EXAMPLES / example)
    if tied is not None:
        config = dataclasses.replace(config, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return Llama(config, block_size=block)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / (1e-12 + b.double().abs().max()))


def check_sp_parity(example: str, tied: bool | None = None, ckpt: bool = False, seq: int = 16,
                    steps: int = 3, lr: float = 0.5) -> dict[str, float]:
    """SGD steps of the tp=2 sequence-parallel decoder (its own plan; ``ckpt``: every layer checkpointed) and of
    one device: per step the loss, the forward's logits and every gradient (relative to its largest element)
    agree to 1e-5. ``seq`` odd: uneven sequence pieces. Returns the worst relative errors."""
    m = mesh(tp=2)
    ref = _model(example, tied, seq)
    model = _model(example, tied, seq)
    vocab = ref.config.vocab_size
    model = sw.parallelize(model, m, model.tensor_parallel_plan(sequence_parallel=True), axis="tp",
                           sequence_parallel=True)
    if ckpt:
        names = set(model.block_names())
        checkpoint_layers(model, policy=lambda name, _m: name in names)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=lr)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(1)
    err = {"loss": 0.0, "logits": 0.0, "grad": 0.0}
    losses = []
    for _ in range(steps):
        stream = torch.randint(0, vocab, (4, seq + 1), generator=gen)
        x, y = stream[:, :-1], stream[:, 1:]
        ref_opt.zero_grad()
        opt.zero_grad()
        ref_logits = ref(x)
        ref_loss = lm_loss(ref_logits, y)
        ref_loss.backward()
        logits = model(x)  # (b, t, v/tp): the head gathers the sequence, the vocabulary stays split
        loss = vocab_parallel_cross_entropy(logits, y, mesh=m, axis="tp", vocab_size=vocab)
        loss.backward()
        start = shard_offsets(vocab, m.size("tp"))[m.coord("tp")]  # this rank's vocabulary rows
        err["logits"] = max(err["logits"], _rel(logits.detach(), ref_logits.detach()[..., start:start + logits.size(-1)]))
        err["loss"] = max(err["loss"], abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
        grads = {n: p.grad for n, p in ref.named_parameters()}
        names = [n for n, _ in model.named_parameters()]
        assert names == list(grads), (names, list(grads))
        for n, p in model.named_parameters():  # collective over tp for the sharded ones: same order on every rank
            assert p.grad is not None, n
            err["grad"] = max(err["grad"], _rel(full_tensor(p, p.grad), grads[n]))
        ref_opt.step()
        opt.step()
        losses.append(loss.item())
    assert len(set(losses)) == len(losses), losses  # parameters moved: not a trivial agreement
    assert max(err.values()) < 1e-5, err
    full = sw.full_state_dict(model)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")
    return err


def check_sp_comm(example: str, seq: int = 16) -> tuple[dict[str, int], dict[str, int]]:
    """Collectives (tp axis, by op) of one forward + vocab-parallel loss and one backward."""
    m = mesh(tp=2)
    model = _model(example, None, seq)
    model = sw.parallelize(model, m, model.tensor_parallel_plan(sequence_parallel=True), axis="tp",
                           sequence_parallel=True)
    stream = torch.randint(0, model.config.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(2))
    with CommCounter() as fwd:
        loss = vocab_parallel_cross_entropy(model(stream[:, :-1]), stream[:, 1:], mesh=m, axis="tp",
                                            vocab_size=model.config.vocab_size)
    with CommCounter() as bwd:
        loss.backward()
    assert all(r.axis == "tp" for r in fwd.records + bwd.records)
    return fwd.by_op(), bwd.by_op()
