"""Rank-side checks: a Hugging Face model's own ``.loss`` (``model(ids, labels=ids)``) under a vocabulary-parallel
LM head equals the one-device model's, value and every gradient (run by tests/dist/test_model_loss.py). The
reference is the same model built from the same seed in the same process, fed the same batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

import shardwise as sw
from shardwise.parallel.tensor.apply_plan import full_tensor
from tests.dist.meshes import mesh

SEQ, BATCH = 8, 3
SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=SEQ)


def _build(arch: str, vocab: int) -> nn.Module:
    import transformers as tf
    if arch == "gpt2":  # tied wte / lm_head
        cfg: Any = tf.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=SEQ,
                                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    conf, cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM), "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
                 "mistral": (tf.MistralConfig, tf.MistralForCausalLM)}[arch]
    cfg = conf(vocab_size=vocab, num_key_value_heads=2, tie_word_embeddings=arch == "qwen2", **SMALL)  # GQA 4/2
    return cls(cfg)


def _plan(arch: str) -> dict[str, Any]:
    """The head vocabulary-parallel; a tied embedding must then be split the same way."""
    plan: dict[str, Any] = {"lm_head": sw.VocabParallel()}
    if arch == "gpt2":
        plan["transformer.wte"] = sw.VocabParallel()
    elif arch == "qwen2":
        plan["model.embed_tokens"] = sw.VocabParallel()
    return plan


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    labels = ids.clone()
    labels[0, 2:5] = -100  # ignored positions (padding): excluded from the mean
    return ids, labels


def _loss_and_grads(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, **kw: Any
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    loss = model(input_ids=ids, labels=labels, **kw).loss
    loss.backward()
    grads = {n: full_tensor(p, p.grad) for n, p in model.named_parameters()}  # gathered over tp where split
    return loss.detach(), grads


def check_own_loss(arch: str, vocab: int, items: int | None = None, auto: bool = False) -> float:
    """``model(ids, labels=labels).loss`` and all gradients with tp=2 and a vocabulary-parallel head equal one
    device (rtol 1e-5). ``items``: pass ``num_items_in_batch`` (sum over tokens / items). ``auto``: the plan is
    ``sw.auto``'s (traced with the labels, the head pinned to the vocabulary split). Returns the loss."""
    m = mesh(tp=2)
    ids, labels = _batch(vocab)
    kw = {} if items is None else {"num_items_in_batch": torch.tensor(items)}
    torch.manual_seed(0)
    ref_loss, ref_grads = _loss_and_grads(_build(arch, vocab), ids, labels, **kw)
    torch.manual_seed(0)
    model = _build(arch, vocab)
    plan: Any = _plan(arch)
    if auto:
        # one mesh axis: without the pin a model this small is cheapest pure data parallel
        plan = sw.auto(model, m, example_inputs={"input_ids": ids, "labels": labels}, pins={"lm_head": "vocab"})
        assert plan.vocab_parallel_loss and isinstance(plan.get("lm_head"), sw.VocabParallel), dict(plan)
    model = sw.parallelize(model, m, plan, axis="tp")
    head = model.get_submodule("lm_head").weight
    assert head.shape[0] < vocab  # the head really is split (this rank holds part of the vocabulary)
    loss, grads = _loss_and_grads(model, ids, labels, **kw)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))
    for k, g in ref_grads.items():
        torch.testing.assert_close(grads[k], g, rtol=1e-5, atol=1e-7, msg=lambda s, k=k: f"{k}: {s}")
    return loss.item()


class _OwnLossModel(nn.Module):
    """Takes ``labels`` and computes its loss inline (no ``loss_function`` to replace)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        if labels is None:
            return logits
        return nn.functional.cross_entropy(logits.view(-1, 16), labels.view(-1))


def check_unreachable_loss() -> str:
    """A model with an inline loss: ``labels`` is refused with a one-line error; without labels it still runs."""
    m = mesh(tp=2)
    torch.manual_seed(0)
    model = sw.parallelize(_OwnLossModel(), m, {"head": sw.VocabParallel()}, axis="tp")
    ids = torch.randint(0, 16, (2, 4))
    assert model(ids).shape == (2, 4, 8)  # logits only: the caller's vocab_parallel_cross_entropy path
    try:
        model(ids, labels=ids)
    except ValueError as e:
        msg = str(e)
        assert "\n" not in msg and "vocab_parallel_cross_entropy" in msg and "'head'" in msg, msg
        return msg
    raise AssertionError("labels with an unreachable loss under a vocabulary-parallel head were not refused")


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.lm = inner

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=ids, labels=labels).loss


def check_wrapped_hf_model(vocab: int = 65) -> None:
    """An HF model inside the user's own module (the plan names ``lm.lm_head``): its loss is still reached."""
    m = mesh(tp=2)
    ids, labels = _batch(vocab)
    torch.manual_seed(0)
    ref = _build("llama", vocab)(input_ids=ids, labels=labels).loss
    torch.manual_seed(0)
    model = sw.parallelize(_Wrapper(_build("llama", vocab)), m, {"lm.lm_head": sw.VocabParallel()}, axis="tp")
    torch.testing.assert_close(model(ids, labels), ref, rtol=1e-5, atol=0)
