"""Selective activation checkpointing: keep the weight matmuls' outputs, recompute the rest of a block.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models", §5) observe that the
activations a transformer block keeps are dominated by tensors that are cheap to recompute — the attention core
(scores, softmax, dropout, the product with ``V``: the ``s²`` terms), the norms, the activation function, the
residual adds — while the weight GEMMs, which cost almost all the FLOPs, produce a minority of the bytes.
Selective checkpointing keeps the outputs of the weight GEMMs and recomputes everything else in backward: the
attention core and the other cheap, memory-heavy operations. The planner counts the same
(``planner/memory.py``: a block keeps its weight GEMMs' outputs and its input).

Mechanism: the block runs under non-reentrant ``torch.utils.checkpoint`` with a per-operation policy
(``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the weight matmuls (``mm``,
``addmm``, and a mixture of experts' ``_grouped_mm``; a linear layer on a 3-D input runs as one of them) are
cached in forward, every other ATen op is re-run when backward replays the block. Attention's own products run
as ``bmm``/``baddbmm`` or inside a fused ``scaled_dot_product_*`` kernel, so they are recomputed. Because the
policy is per operation, the same code serves our GPT, the Llama-style models and ``transformers`` decoders
(eager or SDPA attention), under tensor parallelism, ZeRO and pipelines. Recomputation runs a block's forward
again minus its weight GEMMs (about a third of full checkpointing's extra work on a GPT block with fused
attention, where the core is the largest recomputed op); tensor-parallel collectives inside a block run again.

Where the attention is: a block must contain a module whose name or class says attention (``attn``,
``attention``); ``check_attention`` raises a one-line ``ValueError`` before any work otherwise (on a model
without attention, selective checkpointing recomputes nothing it was meant for — use full checkpointing).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["MODES", "SAVED_OPS", "check_mode", "check_attention", "has_attention", "selective_context",
           "matmul_policy", "checkpoint_kwargs"]

MODES = ("none", "full", "selective")
"""Activation checkpointing modes: nothing recomputed, each block recomputed from its input, each block's
operations but its weight matmuls recomputed."""


def _ops(names: Iterable[str]) -> frozenset[Any]:
    found = []
    for name in names:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            found.extend(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(found)


SAVED_OPS = _ops(["mm", "addmm", "_grouped_mm"])
"""The weight matmuls (each overload): their outputs are kept under ``selective``; every other op is recomputed."""


def check_mode(mode: Any) -> str:
    """``mode`` as one of ``MODES`` (``True`` → ``full``, ``False`` → ``none``, as the old boolean meant);
    ``ValueError`` naming the choices otherwise. Pure."""
    if isinstance(mode, bool):
        return "full" if mode else "none"
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is not one of {list(MODES)} (or True/False for "
                         f"full/none)")
    return str(mode)


def matmul_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the weight matmuls' outputs (``SAVED_OPS``), recompute every other op."""
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context() -> Any:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` (non-reentrant) applying ``matmul_policy``: a
    fresh pair of contexts per call, as torch requires."""
    return create_selective_checkpoint_contexts(matmul_policy)


def checkpoint_kwargs(mode: str) -> dict[str, Callable[[], Any]]:
    """Extra keyword arguments of ``torch.utils.checkpoint.checkpoint`` for ``mode`` (full: none)."""
    return {"context_fn": selective_context} if mode == "selective" else {}


def has_attention(module: nn.Module) -> bool:
    """Whether ``module`` contains a submodule (itself included) whose attribute name or class name says
    attention (``attn`` / ``attention``, any case)."""
    for name, m in module.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        kind = type(m).__name__.lower()
        if "attn" in leaf or "attention" in leaf or "attention" in kind or "attn" in kind:
            return True
    return False


def check_attention(blocks: Iterable[tuple[str, nn.Module]]) -> None:
    """Raise a one-line ``ValueError`` when a block to checkpoint selectively has no attention module."""
    for name, block in blocks:
        if not has_attention(block):
            children = [n for n, _ in block.named_children()] or ["(none)"]
            raise ValueError(f"selective activation checkpointing recomputes the attention core, and block "
                             f"{name!r} ({type(block).__name__}, children {children}) has no attention module (a "
                             f"submodule named or typed 'attn'/'attention'); use --parallel.activation_checkpointing "
                             f"full (checkpoint_layers(model, mode='full'))")
