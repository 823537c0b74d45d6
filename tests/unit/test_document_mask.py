"""Packed documents that do not see each other (``parallel/context/documents.py``), in one process.

A row packing three documents (EOS-separated, the EOS closing its document) gives every document the logits it
gets alone (relative 1e-5, fp32), for the reference GPT and the Llama family (grouped-query attention); the summed
loss and every gradient of a packed batch equal the sums over the documents run alone; activation checkpointing
keeps the layout through recomputation. A row with one document is the plain causal forward, bit for bit. The
ring's block pairs cover exactly the document-causal mask (checked against a dense mask built here). The
config's ``data.document_mask`` and its ``auto`` resolution. Multi-rank layouts: tests/dist/test_document_mask.py.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.models.hf_config import load_hf_config
from shardwise.models.llama import Llama, rotary_tables
from shardwise.parallel.context.documents import (document_attention, document_block_pairs, document_spans,
                                                  documents_from_tokens)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "hf"
EOS = 3
DOCS = [[5, 6, 7, 8, EOS], [9, 10, 11, 12, 13, 14, EOS], [15, 16, 17, 18]]  # 5 + 7 + 4 = 16 tokens


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).abs().max() / b.detach().abs().max())


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if kind == "gpt":
        return sw.models.GPT(sw.models.GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32))
    return Llama(load_hf_config(EXAMPLES / "tiny-llama.json"), block_size=32)  # 4 query heads, 2 key/value heads


def test_layout_of_a_packed_row():
    idx = torch.tensor([[1, 2, EOS, 4, EOS, 6, 7, 8], [EOS, 1, 2, 3 + 1, 5, 6, 7, EOS]])
    d = documents_from_tokens(idx, EOS)
    assert d.spans == (((0, 3), (3, 5), (5, 8)), ((0, 1), (1, 8)))
    assert d.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert d.ids().tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert document_spans(torch.zeros(1, 4, dtype=torch.bool)) == (((0, 4),),)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_each_document_sees_only_itself(kind):
    model = _model(kind)
    other = [DOCS[1], DOCS[0], DOCS[2]]  # the last document has no EOS: the row ends it
    rows = torch.stack([torch.tensor(sum(DOCS, [])), torch.tensor(sum(other, []))])  # two layouts
    model.document_eos_id = EOS
    packed = model(rows)
    model.document_eos_id = None
    plain = model(rows)
    assert rel(plain, packed) > 1e-2  # without the mask the later documents see the earlier ones
    for r, order in enumerate((DOCS, other)):
        at = 0
        for doc in order:
            alone = model(torch.tensor([doc]))
            assert rel(packed[r:r + 1, at:at + len(doc)], alone) < 1e-5, (kind, r, doc)
            at += len(doc)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_loss_and_gradients_are_the_sums_over_documents(kind):
    model = _model(kind)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    row = torch.tensor([sum(DOCS, [])])
    targets = torch.randint(0, 64, row.shape, generator=g)
    model.document_eos_id = EOS
    logits = model(row)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum")
    loss.backward()
    total, at = 0.0, 0
    for doc in DOCS:
        out = ref(torch.tensor([doc]))
        part = F.cross_entropy(out.reshape(-1, out.size(-1)), targets[0, at:at + len(doc)], reduction="sum")
        part.backward()
        total, at = total + part.detach(), at + len(doc)
    assert rel(loss.detach(), total) < 1e-5
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        assert rel(p.grad, grads[name].grad) < 1e-5, name


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_activation_checkpointing_recomputes_with_the_documents(kind):
    model = _model(kind)
    ckpt = copy.deepcopy(model)
    blocks = "blocks." if kind == "gpt" else "model.layers."
    depth = blocks.count(".")
    sw.checkpoint_layers(ckpt, policy=lambda name, _m: name.startswith(blocks) and name.count(".") == depth)
    row = torch.tensor([sum(DOCS, [])])
    for m in (model, ckpt):
        m.document_eos_id = EOS
        m(row).square().sum().backward()
    grads = dict(ckpt.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_one_document_is_the_plain_forward_bit_for_bit(kind):
    model = _model(kind)
    row = torch.arange(10, 26).unsqueeze(0)  # no EOS: one document
    plain = model(row)
    model.document_eos_id = EOS
    assert torch.equal(model(row), plain)


def test_rotary_tables_per_row():
    c = load_hf_config(EXAMPLES / "tiny-llama.json")
    pos = torch.tensor([[0, 1, 2, 0], [3, 0, 1, 2]])
    cos, sin = rotary_tables(4, c, torch.device("cpu"), torch.float32, positions=pos)
    assert cos.shape == (2, 1, 4, c.head_dim)
    for r in range(2):
        want = rotary_tables(4, c, torch.device("cpu"), torch.float32, positions=pos[r])
        assert torch.equal(cos[r, 0], want[0]) and torch.equal(sin[r, 0], want[1])


def test_attention_matches_a_dense_document_mask_with_grouped_heads():
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(4, 20, (2, 24), generator=g)
    idx[0, [4, 11]], idx[1, [0, 20]] = EOS, EOS
    d = documents_from_tokens(idx, EOS)
    q, k, v = torch.randn(2, 4, 24, 8, generator=g), torch.randn(2, 2, 24, 8, generator=g), torch.randn(2, 2, 24, 8, generator=g)
    ids = d.ids()
    allowed = (ids[:, None, :, None] == ids[:, None, None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True)
    assert rel(document_attention(q, k, v, d, enable_gqa=True), want) < 1e-5


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_ring_block_pairs_cover_the_document_causal_mask(cp):
    S = 12 * cp
    eos = torch.zeros(2, S, dtype=torch.bool)
    eos[0, [2, 9, S // 2]] = True  # a document across chunk boundaries, one inside a chunk
    eos[1, [S - 3]] = True
    spans = document_spans(eos)
    ids = documents_from_tokens(eos.long() * EOS, EOS).ids()
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    c = S // (2 * cp)
    for rank in range(cp):
        glob = list(range(rank * c, rank * c + c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))
        covered = torch.zeros(2, 2 * c, S, dtype=torch.int64)  # (row, local query, global key): times covered
        for src in range(cp):
            keys = list(range(src * c, src * c + c)) + list(range((2 * cp - 1 - src) * c, (2 * cp - src) * c))
            for bs, rows, cols, diag in document_block_pairs(rank, src, cp, 2 * c, spans):
                for qi in range(rows.start, rows.stop):
                    for kj in range(cols.start, cols.stop):
                        if not diag or kj - cols.start <= qi - rows.start:
                            covered[bs, qi, keys[kj]] += 1
        assert torch.equal(covered, allowed[:, glob, :].long()), rank


def test_config_document_mask_spellings():
    from shardwise.runtime.config import load_config

    assert load_config().data.document_mask == "auto"
    for given, want in (("true", "true"), ("false", "false"), (True, "true"), (False, "false"), ("1", "true")):
        assert load_config(overrides={"data.document_mask": given}).data.document_mask == want
    with pytest.raises(ValueError, match="data.document_mask"):
        load_config(overrides={"data.document_mask": "sometimes"})


def test_auto_is_on_for_fine_tuning_data_only():
    from shardwise.data.sources import TrainData
    from shardwise.runtime.config import load_config
    from shardwise.runtime.documents import document_eos, enable_documents

    def cfg(mode: str):
        return load_config(overrides={"data.document_mask": mode})

    sft, text, bare = (TrainData(None, None, masked=True, eos_id=7), TrainData(None, None, masked=False, eos_id=7),
                       TrainData(None, None, masked=False))  # type: ignore[arg-type]
    assert [document_eos(cfg("auto"), d) for d in (sft, text, bare)] == [7, None, None]
    assert [document_eos(cfg("true"), d) for d in (sft, text)] == [7, 7]
    assert document_eos(cfg("false"), sft) is None
    with pytest.raises(ValueError, match="document_mask = true needs packed documents"):
        document_eos(cfg("true"), bare)

    class Strategy:  # one process: the model derives the layout itself
        plain, model = _model("gpt"), None

    assert enable_documents(cfg("auto"), Strategy, sft) == 7 and Strategy.plain.document_eos_id == 7
    Strategy.plain = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="cannot mask packed documents"):
        enable_documents(cfg("true"), Strategy, sft)


def test_documents_of_another_batch_are_refused_in_one_line():
    d = documents_from_tokens(torch.tensor([[1, EOS, 2, 4]] * 2), EOS)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=r"documents describe 2 rows of 4 tokens, the queries 1 rows of 4") as e:
        document_attention(q, q, q, d)
    assert "\n" not in str(e.value)
