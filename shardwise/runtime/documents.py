"""``data.document_mask`` in ``shardwise train``: packed documents that do not see each other, in every layout.

The layout of a batch's documents is a function of its token ids and the dataset's EOS id
(``parallel/context/documents.py``), so nothing travels with a batch: the model derives it from the ids it is
given. What this module sets up, once, after the strategy and the context split are built:

* every layout that calls the model on token ids (one process, ``DataParallel``, ``sw.parallelize``, ``sw.zero``,
  activation checkpointing, compiled blocks): the model's ``document_eos_id`` — its ``forward`` derives the layout
  and hands it to each block explicitly (recomputation in backward gets it again as an argument);
* a pipeline: its interpreter's ``microbatch_context`` — every stage rank holds each micro-batch's token ids, so
  each derives the layout and runs that micro-batch's forward, backward and recomputation with it active;
* context parallelism: the derivation gathers the whole rows' EOS map over cp (positions are the whole
  document's) and the ring attention masks its blocks by document.

``auto`` resolves to on for loss-masked (fine-tuning) data and off otherwise.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..data.sources import TrainData
from ..parallel.context.documents import microbatch_documents
from .config_schema import Config

__all__ = ["document_eos", "enable_documents"]


def document_eos(cfg: Config, data: TrainData) -> int | None:
    """The EOS id the run masks documents by, or None (``data.document_mask`` false, or auto on data without a
    loss mask). ``ValueError`` when masking is asked for and the data has no EOS (``check_data`` says it first)."""
    mode = cfg.data.document_mask
    if mode == "false" or (mode == "auto" and not data.masked):
        return None
    if data.eos_id is None:
        if mode == "auto":
            return None
        raise ValueError(f"data.document_mask = true needs packed documents with an EOS between them, but "
                         f"data.path = {cfg.data.path!r} has none; prepare it with shardwise prepare, or set "
                         f"--data.document_mask false")
    return data.eos_id


def _sequence_layout(model: nn.Module) -> Any:
    """The context-parallel ``SeqLayout`` ``sw.context_parallel`` gave ``model``'s modules, or None."""
    for module in model.modules():
        layout = getattr(module, "sequence_layout", None)
        if layout is not None:
            return layout
    return None


def enable_documents(cfg: Config, strategy: Any, data: TrainData) -> int | None:
    """Turn document masking on in ``strategy``'s model (module docstring); returns the EOS id or None. Call after
    ``context_split``. ``ValueError`` for a model that cannot mask documents."""
    eos = document_eos(cfg, data)
    if eos is None:
        return None
    plain = strategy.plain
    if not hasattr(type(plain), "document_eos_id"):
        raise ValueError(f"data.document_mask: the model {type(plain).__name__} cannot mask packed documents (the "
                         f"reference GPT and the Llama family can); set --data.document_mask false")
    plain.document_eos_id = eos
    interpreter = getattr(strategy.model, "interpreter", None)
    if interpreter is not None:  # sw.pipeline: each stage derives the micro-batch's documents itself
        layout = _sequence_layout(plain)
        interpreter.microbatch_context = microbatch_documents(eos, lambda: layout)
    return eos
