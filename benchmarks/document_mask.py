"""The document-masked attention's step time against unmasked causal attention at the same length.

    python benchmarks/document_mask.py [--seq 2048] [--doc-len 256] [--batch 2] [--heads 8] [--kv-heads 2]
                                       [--head-dim 64] [--repeats 7] [--device cpu]

Three kernels on the same (b, h, t, d) queries and (b, hkv, t, d) keys/values, forward + backward, best of
``--repeats`` after one warm-up:

* ``causal``: ``F.scaled_dot_product_attention(is_causal=True)`` over the whole row (what runs without a mask);
* ``documents``: ``document_attention`` (one causal SDPA per document: the kernel ``--data.document_mask`` runs);
* ``dense-mask``: SDPA with a materialised (t, t) boolean document-causal mask (the path not taken).

Documents have lengths drawn uniformly in [doc_len / 2, 3 doc_len / 2] (the last one cut by the row's end).
Also the whole step of a model (``--model gpt`` small GPT at ``--seq``) with and without the mask. Prints one
JSON object. Nothing here is asserted: it is a measurement (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise.parallel.context.documents import document_attention, documents_from_tokens

EOS = 0


def _rows(b: int, t: int, doc_len: int, vocab: int, g: torch.Generator) -> torch.Tensor:
    ids = torch.randint(1, vocab, (b, t), generator=g)
    for r in range(b):
        at = 0
        while True:
            at += int(torch.randint(doc_len // 2, doc_len * 3 // 2 + 1, (1,), generator=g))
            if at > t:
                break
            ids[r, at - 1] = EOS
    return ids


def _best(fn: Callable[[], torch.Tensor], repeats: int, device: torch.device) -> float:
    fn().sum().backward()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn().sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def attention_times(a: argparse.Namespace, device: torch.device) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    ids = _rows(a.batch, a.seq, a.doc_len, 1000, g)
    docs = documents_from_tokens(ids.to(device), EOS)
    q = torch.randn(a.batch, a.heads, a.seq, a.head_dim, generator=g).to(device).requires_grad_()
    k, v = (torch.randn(a.batch, a.kv_heads, a.seq, a.head_dim, generator=g).to(device).requires_grad_()
            for _ in range(2))
    gqa = a.heads != a.kv_heads
    ids_d = docs.ids().to(device)
    mask = (ids_d[:, None, :, None] == ids_d[:, None, None, :]) & torch.ones(a.seq, a.seq, dtype=torch.bool,
                                                                           device=device).tril()
    kernels = {
        "causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa),
        "documents": lambda: document_attention(q, k, v, docs, enable_gqa=gqa),
        "dense-mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa),
    }
    out = {name: _best(fn, a.repeats, device) for name, fn in kernels.items()}
    out["documents_per_row"] = sum(len(row) for row in docs.spans) / a.batch
    return out


def model_times(a: argparse.Namespace, device: torch.device) -> dict[str, float]:
    g = torch.Generator().manual_seed(1)
    cfg = sw.models.GPTConfig(vocab_size=1000, block_size=a.seq, n_layer=4, n_head=a.heads,
                              n_embd=a.heads * a.head_dim)
    torch.manual_seed(0)
    model = sw.models.GPT(cfg).to(device)
    ids = _rows(a.batch, a.seq, a.doc_len, 1000, g).to(device)
    out = {"model_causal": _best(lambda: model(ids), a.repeats, device)}
    model.document_eos_id = EOS
    out["model_documents"] = _best(lambda: model(ids), a.repeats, device)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--doc-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    device = torch.device(a.device)
    result = {"args": dict(vars(a)), "threads": torch.get_num_threads(), **attention_times(a, device)}
    a.kv_heads = a.heads  # the GPT has no grouped-query attention
    result.update(model_times(a, device))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
