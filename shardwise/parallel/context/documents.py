"""Packed documents: which tokens of a batch row belong together, and attention that keeps them apart.

A packed row (``shardwise prepare`` writes ``tokens(doc) + [EOS]`` after each other) holds several documents.
With a document mask each token attends only to the earlier tokens of its own document, and positions restart
at 0 with every document. **The EOS belongs to the document it ends**: the token after an EOS starts a new
document; a row's first token starts one too (a window may begin inside a document: that part counts as a
document of its own).

``Documents`` is the layout of one batch: each local token's position inside its document, and each row's
document spans in the coordinates of the whole row (under context parallelism a rank holds two chunks of the
row, and the ring needs to know where the other ranks' documents lie). It is derived from the token ids and the
EOS id (``documents_from_tokens``): nothing else travels with a batch.

``document_attention`` is the attention: per row and per document, one causal ``scaled_dot_product_attention``
on that document's slice (a variable-length path: exact, O(Σ len²) work, no (t, t) mask). It honours torch
function modes (``handle_torch_function``), so ``sw.context_parallel``'s ring takes it over as it does SDPA.
``using_documents`` / ``active_documents`` hold the layout of the micro-batch a pipeline stage is running
(``sw.pipeline``'s ``microbatch_context``), whose units cannot take it as an argument.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import handle_torch_function, has_torch_function_variadic

__all__ = ["Documents", "documents_from_tokens", "document_spans", "document_attention", "using_documents",
           "active_documents", "document_block_pairs"]

Spans = tuple[tuple[tuple[int, int], ...], ...]
"""Per row: the ``[start, stop)`` of each document, in order, covering ``0 .. length``."""


@dataclass(frozen=True, eq=False)
class Documents:
    """The document layout of one batch (module docstring).

    ``positions`` (b, t) int64: each local token's position inside its document (the rotary / position
    embedding's input). ``spans``: per row, the documents' ``[start, stop)`` in whole-row coordinates.
    ``length``: the whole row's length ``S`` (``t`` in one process, ``cp · t`` under context parallelism)."""

    positions: Tensor
    spans: Spans
    length: int

    def ids(self) -> Tensor:
        """(b, S) int64 document index of every token of the whole rows (0 for each row's first document)."""
        out = torch.zeros(len(self.spans), self.length, dtype=torch.int64)
        for r, row in enumerate(self.spans):
            for d, (start, stop) in enumerate(row):
                out[r, start:stop] = d
        return out


def document_spans(eos: Tensor) -> Spans:
    """The spans of rows whose EOS tokens are where ``eos`` (b, S) is true: a document ends just after each EOS
    (the EOS is its last token); the last one ends with the row. One host read of the EOS positions."""
    if eos.dim() != 2:
        raise ValueError(f"document_spans takes a (batch, seq) mask of EOS tokens, got shape {tuple(eos.shape)}")
    length = eos.size(1)
    hits = torch.nonzero(eos[:, :-1]).tolist()  # an EOS in the last slot ends the row anyway
    ends: list[list[int]] = [[] for _ in range(eos.size(0))]
    for row, col in hits:
        ends[row].append(col + 1)
    return tuple(tuple(zip([0] + e, e + [length])) for e in ends)


def _positions(eos: Tensor) -> Tensor:
    """(b, S) position of each token inside its document: its index minus its document's first index."""
    b, s = eos.shape
    index = torch.arange(s, device=eos.device).expand(b, s)
    starts = torch.zeros_like(index)
    starts[:, 1:] = torch.where(eos[:, :-1], index[:, 1:], 0)  # a token after an EOS starts a document
    return index - starts.cummax(dim=1).values


def documents_from_tokens(idx: Tensor, eos_id: int, layout: Any = None) -> Documents:
    """The ``Documents`` of token ids ``idx`` (b, t) packed with ``eos_id`` after each document. ``layout``
    (None: ``idx`` is the whole rows): a context-parallel rank's ``SeqLayout`` (``sw.context_parallel`` sets it);
    ``idx`` is then this rank's two chunks, and the whole rows' EOS map is gathered over the cp axis (one
    all-gather of ``b · t`` bytes; collective over cp) so that spans and positions are those of the whole rows."""
    if idx.dim() != 2:
        raise ValueError(f"documents_from_tokens takes (batch, seq) token ids, got shape {tuple(idx.shape)}")
    eos = idx == eos_id
    if layout is None or layout.cp == 1:
        return Documents(_positions(eos), document_spans(eos), idx.size(1))
    whole = layout.unshard(eos.to(torch.uint8)).bool()  # (b, S) in sequence order
    local = layout.positions(idx.size(1), idx.device)  # (t,) global indices of the local tokens
    return Documents(_positions(whole)[:, local], document_spans(whole), whole.size(1))


_EAGER: list[Callable[..., Tensor]] = []
"""``torch.compiler.disable(document_attention)``, made on the first compiled call: decorating at import would
import ``torch._dynamo`` in every process (~1 s and ~75 MiB) whether or not anything is compiled."""


def document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Documents, *, scale: float | None = None,
                       dropout_p: float = 0.0, enable_gqa: bool = False) -> Tensor:
    """Causal attention of ``q`` (b, h, t, d) over ``k``, ``v`` (b, hkv, t, d) within each document of
    ``documents`` → (b, h, t, dv): equal to ``F.scaled_dot_product_attention(is_causal=True)`` run on every
    document alone. One SDPA call per (row, document); no (t, t) mask is built. Under a torch function mode
    (``sw.context_parallel``) the mode decides (the ring attention with document masks). A compiled block runs
    it eagerly (a data-dependent loop over documents: one graph break)."""
    if torch.compiler.is_compiling():
        if not _EAGER:
            _EAGER.append(torch.compiler.disable(_document_attention))
        return _EAGER[0](q, k, v, documents, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa)
    return _document_attention(q, k, v, documents, scale=scale, dropout_p=dropout_p, enable_gqa=enable_gqa)


def _document_attention(q: Tensor, k: Tensor, v: Tensor, documents: Documents, *, scale: float | None = None,
                        dropout_p: float = 0.0, enable_gqa: bool = False) -> Tensor:
    if has_torch_function_variadic(q, k, v):
        return handle_torch_function(document_attention, (q, k, v), q, k, v, documents, scale=scale,
                                     dropout_p=dropout_p, enable_gqa=enable_gqa)
    t = q.size(2)
    if documents.length != t or len(documents.spans) != q.size(0):
        raise ValueError(f"document_attention: the documents describe {len(documents.spans)} rows of "
                         f"{documents.length} tokens, the queries {q.size(0)} rows of {t}; derive them from the "
                         f"same batch (documents_from_tokens)")
    if all(len(row) == 1 for row in documents.spans):  # one document per row: the plain causal call, bit for bit
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=enable_gqa)
    # unbind and split (not slices): their backward writes each gradient once, where a slice's would add a
    # zero-filled copy of the whole tensor per document
    rows = []
    for qr, kr, vr, row in zip(q.unbind(0), k.unbind(0), v.unbind(0), documents.spans):  # (h, t, d) each
        lengths = [stop - start for start, stop in row]
        parts = [F.scaled_dot_product_attention(qd, kd, vd, dropout_p=dropout_p, is_causal=True, scale=scale,
                                                enable_gqa=enable_gqa)
                 for qd, kd, vd in zip(qr.split(lengths, 1), kr.split(lengths, 1), vr.split(lengths, 1))]
        rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))  # (h, t, dv)
    return torch.stack(rows)


_ACTIVE = threading.local()


@contextlib.contextmanager
def using_documents(documents: Documents | None) -> Iterator[None]:
    """Make ``documents`` what ``active_documents()`` returns inside the block (this thread; nests)."""
    prev = getattr(_ACTIVE, "documents", None)
    _ACTIVE.documents = documents
    try:
        yield
    finally:
        _ACTIVE.documents = prev


def active_documents() -> Documents | None:
    """The layout set by the innermost ``using_documents`` of this thread, or None."""
    return getattr(_ACTIVE, "documents", None)


BlockPair = tuple[slice, slice, slice, bool]
"""(batch rows, query rows, key rows, causal diagonal) of one ring block, in local coordinates."""


def document_block_pairs(rank: int, src: int, cp: int, local_len: int, spans: Spans) -> list[BlockPair]:
    """The ring blocks rank ``rank`` computes against rank ``src``'s K/V under a document mask. Local chunk 0 is
    global chunk ``rank`` (keys: ``src``), chunk 1 is ``2·cp−1−rank`` (keys: ``2·cp−1−src``); documents are
    contiguous, so the allowed part of a (query chunk a, key chunk c ≤ a) block is one rectangle per document
    present in both chunks — full for c < a, the causal diagonal of the document's own square for c == a. Pairs
    of chunks sharing no document give no block (skipped)."""
    c = local_len // 2
    q_chunks, k_chunks = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
    pairs: list[BlockPair] = []
    for r, row in enumerate(spans):
        for i, a in enumerate(q_chunks):
            for j, b in enumerate(k_chunks):
                if b > a:
                    continue
                qa, ka = a * c, b * c  # the chunks' first global indices
                for start, stop in row:
                    qs, qe, ks, ke = max(start, qa), min(stop, qa + c), max(start, ka), min(stop, ka + c)
                    if qs < qe and ks < ke:
                        pairs.append((slice(r, r + 1), slice(i * c + qs - qa, i * c + qe - qa),
                                      slice(j * c + ks - ka, j * c + ke - ka), a == b))
    return pairs


def microbatch_documents(eos_id: int, layout_of: Callable[[], Any]) -> Callable[[Any], Any]:
    """A pipeline's ``microbatch_context``: given a micro-batch's token ids, the context in which its stages run
    with its ``Documents`` active (``layout_of()``: the model's context-parallel ``SeqLayout`` or None)."""
    def context(idx: Any) -> Any:
        if not isinstance(idx, Tensor):
            return contextlib.nullcontext()
        return using_documents(documents_from_tokens(idx, eos_id, layout_of()))
    return context
