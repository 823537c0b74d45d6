"""Rank-side checks for HF decoders (``models/llama.py``) under tensor parallelism and the pipeline (run inside
LocalWorld ranks by tests/dist/test_hf_parallel.py). The reference is the single-device decoder built from the same
seed and trained on the same batches in the same process; the parallel model is compared through
``sw.full_state_dict`` under HF's keys."""

from __future__ import annotations

from pathlib import Path

import torch

import shardwise as sw
from shardwise.comm import CommCounter
from shardwise.models.gpt import lm_loss, synthetic_batch
from shardwise.models.hf_config import load_hf_config
from shardwise.models.llama import Llama
from shardwise.parallel.tensor.apply_plan import vocab_parallel_cross_entropy
from tests.dist.meshes import mesh
from tests.dist.reference import sgd_reference

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
SEQ = 16


def _model(example: str) -> Llama:
    torch.manual_seed(0)
    return Llama(load_hf_config(EXAMPLES / example), block_size=SEQ)


def _batches(vocab: int, batch: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [synthetic_batch(batch, SEQ, vocab, gen) for _ in range(steps)]


def _reference(example: str, batches, lr: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    return sgd_reference(_model(example), batches, lr)


def check_tp_parity(example: str, steps: int = 4, lr: float = 0.5) -> list[float]:
    """SGD on the tp=2 decoder (its own plan) and on one device: losses (rtol 1e-5) and every parameter after the
    steps (so every gradient) agree. Returns the parallel losses."""
    m = mesh(tp=2)
    model = _model(example)
    vocab = model.config.vocab_size
    batches = _batches(vocab, 4, steps)
    ref_losses, ref_state = _reference(example, batches, lr)
    model = sw.parallelize(model, m, model.tensor_parallel_plan(), axis="tp")
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = vocab_parallel_cross_entropy(model(x), y, mesh=m, axis="tp", vocab_size=vocab)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    full = sw.full_state_dict(model)
    assert set(full) == set(ref_state), sorted(set(full) ^ set(ref_state))
    for k, v in ref_state.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")
    assert len(set(ref_losses)) == len(ref_losses), ref_losses  # parameters moved: not a trivial agreement
    return losses


def check_tp_comm(example: str) -> tuple[dict[str, int], dict[str, int], int]:
    """Collectives of one forward (+ vocab-parallel loss) and one backward of the tp=2 decoder, by op (tp axis
    only), and the bytes of the forward all-reduces."""
    m = mesh(tp=2)
    model = _model(example)
    model = sw.parallelize(model, m, model.tensor_parallel_plan(), axis="tp")
    x, y = _batches(model.config.vocab_size, 2, 1)[0]
    with CommCounter() as fwd:
        loss = vocab_parallel_cross_entropy(model(x), y, mesh=m, axis="tp", vocab_size=model.config.vocab_size)
    with CommCounter() as bwd:
        loss.backward()
    assert all(r.axis == "tp" for r in fwd.records + bwd.records)
    return fwd.by_op(), bwd.by_op(), fwd.bytes("all_reduce")


def check_pipeline_parity(example: str, schedule: str, split: list[str] | None, steps: int = 3,
                          lr: float = 0.5) -> list[float]:
    """``sw.pipeline`` over pp=2 on the decoder's own units vs one device (SGD): losses and parameters agree."""
    m = mesh(pp=2)
    model = _model(example)
    batches = _batches(model.config.vocab_size, 4, steps)
    ref_losses, ref_state = _reference(example, batches, lr)
    pipe = sw.pipeline(model, m, "pp", microbatches=2, schedule=schedule, loss_fn=lm_loss, split=split)
    opt = pipe.build_optimizer(lambda params: torch.optim.SGD(params, lr=lr))
    losses = []
    for x, y in batches:
        opt.zero_grad()
        losses.append(float(pipe.step(x, y)))
        opt.step()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    full = sw.full_state_dict(pipe)
    for k, v in ref_state.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=lambda s, k=k: f"{k}: {s}")
    return losses
