"""A Hugging Face model's own loss (``model(ids, labels=ids).loss``) under tp=2 with a vocabulary-parallel head
equals one device: the value and every gradient (fp32, rtol 1e-5). Rank-side code: model_loss_checks.py."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.dist import model_loss_checks as mc  # noqa: E402


@pytest.mark.parametrize("arch, vocab", [("llama", 65), ("qwen2", 64), ("mistral", 64), ("gpt2", 63)])
def test_own_loss_matches_single_device(worlds, arch, vocab):
    # llama: GQA 4/2, untied head, uneven vocabulary (33 + 32); qwen2: tied embedding; gpt2: tied, Conv1D blocks
    losses = worlds.get(2).run(mc.check_own_loss, arch, vocab, timeout=120)
    assert losses[0] == losses[1]  # the loss is replicated over tp


def test_own_loss_num_items_in_batch(worlds):
    # the Trainer's path: token sum divided by the number of items over all micro-batches
    worlds.get(2).run(mc.check_own_loss, "llama", 65, 40, timeout=120)


def test_own_loss_with_an_auto_plan(worlds):
    # a plan from sw.auto (head pinned vocab-parallel on the one tp axis): the model's own loss follows
    worlds.get(2).run(mc.check_own_loss, "llama", 1001, None, True, timeout=120)


def test_unreachable_loss_is_refused(worlds):
    msgs = worlds.get(2).run(mc.check_unreachable_loss, timeout=120)
    assert "keep 'head' replicated" in msgs[0]
    worlds.get(2).run(mc.check_wrapped_hf_model, timeout=120)  # an HF model inside the user's module
