"""``context_parallel``: run a model's attention as ring attention over a sequence split along a mesh axis.

While any submodule of the wrapped model runs forward (the recomputation of an activation-checkpointed block
during backward included), ``torch.nn.functional.scaled_dot_product_attention`` is routed to
``ring_attention``: a ``TorchFunctionMode`` entered by a forward pre-hook of every submodule and left by its
forward hook (``always_call``, so an exception leaves nothing behind), counted per thread so that nested
modules enter it once. Nothing in torch is patched; other code keeps the ordinary attention.

Positions: a module whose class declares ``sequence_layout`` gets this rank's ``SeqLayout`` (the model reads
its tokens' global positions from it); a model whose forward takes ``position_ids`` (Hugging Face) gets the
local tokens' positions when the caller passes none, and an all-ones ``attention_mask`` likewise (without the mask
``transformers`` would read the jump between the two chunks' positions as two packed sequences); its own loss
needs ``shift_labels=`` (labels already shifted over the whole sequence, then sharded) besides ``labels=``.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ...mesh import Mesh
from .documents import Documents, document_attention
from .layout import SeqLayout
from .ring import ring_attention

__all__ = ["context_parallel"]

_SDPA = F.scaled_dot_product_attention


def _sdpa_to_ring(mesh: Mesh, axis: str, query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> Tensor:
    if attn_mask is not None:
        raise ValueError(f"context parallelism runs causal or full attention without a mask; the model passed "
                         f"attn_mask of shape {tuple(attn_mask.shape)} (pass is_causal=True and no mask)")
    if dropout_p:
        raise ValueError(f"scaled_dot_product_attention got dropout_p={dropout_p} under context parallelism; "
                         f"set dropout 0 with context parallelism")
    if not enable_gqa and key.shape[-3] != query.shape[-3]:
        raise ValueError(f"scaled_dot_product_attention: {query.shape[-3]} query heads and {key.shape[-3]} key "
                         f"heads need enable_gqa=True")
    return ring_attention(query, key, value, mesh, axis, causal=bool(is_causal), scale=scale)


def _documents_to_ring(mesh: Mesh, axis: str, query: Tensor, key: Tensor, value: Tensor, documents: Documents, *,
                       scale: float | None = None, dropout_p: float = 0.0, enable_gqa: bool = False) -> Tensor:
    if dropout_p:
        raise ValueError(f"document_attention got dropout_p={dropout_p} under context parallelism; set dropout 0 "
                         f"with context parallelism")
    return ring_attention(query, key, value, mesh, axis, causal=True, scale=scale, documents=documents)


class _RingMode(TorchFunctionMode):
    """Routes ``scaled_dot_product_attention`` (and ``document_attention``) to the ring; every other function runs
    as it is."""

    def __init__(self, mesh: Mesh, axis: str) -> None:
        super().__init__()
        self.mesh, self.axis = mesh, axis

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is _SDPA:
            return _sdpa_to_ring(self.mesh, self.axis, *args, **(kwargs or {}))
        if func is document_attention:  # packed documents: the ring with a document mask
            return _documents_to_ring(self.mesh, self.axis, *args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class _Router:
    """The per-thread depth of the wrapped model's running forwards; the mode is on while it is positive."""

    def __init__(self, mesh: Mesh, axis: str) -> None:
        self.mesh, self.axis = mesh, axis
        self._local = threading.local()

    def enter(self, module: nn.Module, args: Any) -> None:
        state = self._local
        depth = getattr(state, "depth", 0)
        if depth == 0:
            state.mode = _RingMode(self.mesh, self.axis)
            state.mode.__enter__()
        state.depth = depth + 1

    def leave(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._local
        state.depth -= 1
        if state.depth == 0:
            mode, state.mode = state.mode, None
            mode.__exit__(None, None, None)


def _local_tokens(args: tuple, kwargs: dict) -> Tensor | None:
    for name in ("input_ids", "inputs_embeds"):
        if kwargs.get(name) is not None:
            return kwargs[name]
    return args[0] if args and isinstance(args[0], Tensor) else None


def _labels_given(args: tuple, kwargs: dict, params: list[str]) -> bool:
    if kwargs.get("labels") is not None:
        return True
    return "labels" in params and len(args) > params.index("labels") and args[params.index("labels")] is not None


def _hf_hook(layout: SeqLayout, params: list[str]) -> Callable:
    """A forward pre-hook (with kwargs) adding ``position_ids`` (and an all-ones ``attention_mask``), and refusing
    ``labels=`` without ``shift_labels=`` (the model would shift them inside this rank's two chunks)."""
    pos_index = params.index("position_ids")
    mask_index = params.index("attention_mask") if "attention_mask" in params else None

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if _labels_given(args, kwargs, params) and kwargs.get("shift_labels") is None:
            raise ValueError("context parallelism: the model would shift labels= inside this rank's tokens, across "
                             "its two chunks; also pass shift_labels=sw.shard_sequence(the labels shifted by one "
                             "over the whole sequence)")
        tokens = _local_tokens(args, kwargs)
        if tokens is None:
            return None
        b, n = tokens.shape[0], tokens.shape[1]
        kwargs = dict(kwargs)
        if kwargs.get("position_ids") is None and len(args) <= pos_index:
            kwargs["position_ids"] = layout.positions(n, tokens.device).unsqueeze(0).expand(b, n)
        if mask_index is not None and kwargs.get("attention_mask") is None and len(args) <= mask_index:
            kwargs["attention_mask"] = torch.ones(b, n, dtype=torch.long, device=tokens.device)
        return args, kwargs
    return hook


def _forward_params(model: nn.Module) -> list[str]:
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY, p.KEYWORD_ONLY)]


def context_parallel(model: nn.Module, mesh: Mesh, axis: str = "cp") -> nn.Module:
    """Run ``model``'s attention as ring attention over ``axis`` of ``mesh``; returns ``model`` (modified in
    place). Feed every rank its tokens in the balanced layout (``shard_sequence``); the model's outputs are
    those of its local tokens, equal to one device's at those positions, and parameter gradients are this
    rank's share (sum them over ``axis``, as data parallelism over ``axis`` does)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"context_parallel takes an nn.Module, got {type(model).__name__}")
    if axis not in mesh.axes:
        raise ValueError(f"context_parallel: axis {axis!r} is not an axis of the mesh {mesh.axes}; pass axis= one "
                         f"of them (e.g. sw.Mesh(dp=2, cp=2) and axis='cp')")
    if getattr(model, "_shardwise_context_parallel", None) is not None:
        raise ValueError("context_parallel was already applied to this model; apply it once")
    layout = SeqLayout(mesh.size(axis), mesh.coord(axis), mesh=mesh, axis=axis)
    router = _Router(mesh, axis)
    handles = []
    for module in model.modules():
        if hasattr(type(module), "sequence_layout"):
            module.sequence_layout = layout
        handles.append(module.register_forward_pre_hook(router.enter))
        handles.append(module.register_forward_hook(router.leave, always_call=True))
    params = _forward_params(model)
    if "position_ids" in params:
        handles.append(model.register_forward_pre_hook(_hf_hook(layout, params), with_kwargs=True,
                                                       prepend=True))
    model._shardwise_context_parallel = (layout, handles)
    return model
