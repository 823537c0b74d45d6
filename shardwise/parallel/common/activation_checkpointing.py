"""Activation checkpointing: keep only a block's input, recompute its activations during backward.

``checkpoint_layers(model)`` replaces the *forward* of selected modules (by default every element of a
``ModuleList`` named ``blocks``) with one that runs under ``torch.utils.checkpoint.checkpoint`` in its
non-reentrant form (``use_reentrant=False``). The module tree is untouched, so parameter names and
``state_dict`` keys do not change, and because the non-reentrant form recomputes inside the *same*
backward pass, each parameter's gradient is accumulated — and its gradient hooks fire — exactly once per
backward (data parallelism's bucketed all-reduce relies on that). The reentrant form would run a nested
backward per block instead. Cost: one extra forward of each checkpointed block; saving: the block's
internal activations (for n blocks checkpointing every √n-th block bounds memory at ~√n blocks' worth).
Forward hooks on a checkpointed module fire once per forward; hooks on its *submodules* fire again during
the recomputation in backward.

``activation_memory(model, fn)`` measures the bytes a forward pass keeps alive for backward, and
``checkpoint_report(model, fn)`` compares that with and without the checkpointing applied. Nothing here
communicates.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from torch.utils._pytree import tree_flatten

from .selective import check_attention, check_mode, checkpoint_kwargs, selective_context

__all__ = ["checkpoint_layers", "remove_checkpointing", "checkpointed_modules", "activation_memory",
           "checkpoint_report", "ActivationReport", "Policy"]

Policy = Callable[[str, nn.Module], bool]
"""``policy(qualified_name, module) -> bool``: whether to checkpoint that module."""

# Storages counted by the active ``activation_memory`` call, {data_ptr: storage}, or None. Holding the
# storage object keeps it alive, so a freed address cannot be reused and then mistaken for a duplicate.
_METER: contextvars.ContextVar[dict[int, torch.UntypedStorage] | None] = contextvars.ContextVar(
    "sw_activation_meter", default=None)
# The caches of selective checkpointing's saving contexts opened under the active meter ({op: {i: outputs}}).
_CACHES: contextvars.ContextVar[list[Any]] = contextvars.ContextVar("sw_selective_caches", default=[])


class _CheckpointedForward:
    """Instance-level ``forward`` of a checkpointed module (class-level forward is left alone). ``mode``: ``full``
    (the module keeps only its inputs) or ``selective`` (``selective.py``: only the attention core is
    recomputed)."""

    def __init__(self, module: nn.Module, mode: str = "full") -> None:
        self.module = module
        self.mode = mode
        self.enabled = True
        self.body: Callable[..., Any] | None = None
        """What runs under the checkpoint instead of the class forward (``sw.compile``: the compiled forward)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        original = type(self.module).forward if self.body is None else _unbound(self.body)
        if not self.enabled or not torch.is_grad_enabled():
            return original(self.module, *args, **kwargs)
        meter = _METER.get()
        if meter is not None:
            # Checkpointing keeps the block's inputs alive by reference (not through autograd's saved
            # tensors), so count them explicitly: they are exactly what this block keeps for backward.
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    _count(meter, value)
        how = checkpoint_kwargs(self.mode)
        if meter is not None and how:  # selective: the outputs it keeps sit in the policy's cache, not in autograd
            how = {"context_fn": lambda: _metered(meter, selective_context())}
        return checkpoint(original, self.module, *args, use_reentrant=False, **how, **kwargs)


def _metered(meter: dict[int, torch.UntypedStorage], contexts: tuple[Any, Any]) -> tuple[Any, Any]:
    """Selective checkpointing's contexts with the saving one's cache registered with ``meter``: what it caches
    in forward is what the block keeps for backward (``activation_memory`` counts it when the forward is over)."""
    store = getattr(contexts[0], "storage", None)
    if store is not None:
        _CACHES.get().append(store)
    return contexts


def _unbound(body: Callable[..., Any]) -> Callable[..., Any]:
    """``body`` called like the class forward, ``(module, *args)`` (``body`` holds its module already)."""
    return lambda _module, *args, **kwargs: body(*args, **kwargs)


def _is_checkpointed(module: nn.Module) -> bool:
    return isinstance(module.__dict__.get("forward"), _CheckpointedForward)


def _select(model: nn.Module, policy: Policy | None) -> list[tuple[str, nn.Module]]:
    """Modules chosen by ``policy`` (default: elements of ModuleLists named ``blocks``), outermost only."""
    if policy is None:
        lists = [(name, m) for name, m in model.named_modules()
                 if isinstance(m, nn.ModuleList) and name.rsplit(".", 1)[-1] == "blocks"]
        chosen = [(f"{name}.{i}", child) for name, lst in lists for i, child in enumerate(lst)]
    else:
        chosen = [(name, m) for name, m in model.named_modules() if name and policy(name, m)]
    # A module inside an already chosen one is covered by its ancestor's recomputation.
    outer: list[tuple[str, nn.Module]] = []
    for name, m in chosen:
        if not any(name.startswith(prefix + ".") for prefix, _ in outer):
            outer.append((name, m))
    return outer


def checkpoint_layers(model: nn.Module, *, every: int = 1, policy: Policy | None = None,
                      mode: str = "full") -> nn.Module:
    """Checkpoint the selected modules of ``model`` in place and return ``model``.

    Selection: ``policy(name, module)`` if given, else every element of any ``nn.ModuleList`` named
    ``blocks``; a module nested inside a selected one is skipped. ``every=k`` keeps the selected modules
    at positions 0, k, 2k, … (in module order). ``mode``: ``"full"`` (each selected module keeps only its
    inputs and recomputes the rest in backward) or ``"selective"`` (only its attention core is recomputed, every
    other activation is kept: ``selective.py``; each selected module must contain an attention module). Raises
    ``ValueError`` when ``every < 1``, for another mode, when nothing is selected, when a selective block has no
    attention, or when a selected module is already checkpointed (call ``remove_checkpointing`` first).
    """
    mode = check_mode(mode)
    if mode == "none":
        raise ValueError("checkpoint_layers(mode='none') would checkpoint nothing; call it with mode='full' or "
                         "'selective', or do not call it")
    if not isinstance(every, int) or isinstance(every, bool) or every < 1:
        raise ValueError(f"every must be a positive int (checkpoint every k-th block), got {every!r}; e.g. every=1 "
                         f"(every block) or every=2")
    selected = _select(model, policy)
    if not selected:
        top = [name for name, _ in model.named_children()]
        what = "the given policy" if policy is not None else "the default policy (elements of a ModuleList named 'blocks')"
        raise ValueError(f"checkpoint_layers: {what} matched no module in {type(model).__name__} "
                         f"(top-level children: {top}); pass policy=lambda name, module: ... to choose modules")
    twice = [name for name, m in selected if _is_checkpointed(m)]
    if twice:
        raise ValueError(f"modules {twice} are already checkpointed; checkpoint_layers was applied twice — "
                         "call remove_checkpointing(model) first to change the selection")
    if mode == "selective":
        check_attention(selected[::every])
    for name, module in selected[::every]:
        # nn.Module.__setattr__ stores a plain callable in the instance __dict__, shadowing the class
        # forward; parameters and submodules are untouched, so names and state_dict keys stay the same.
        module.forward = _CheckpointedForward(module, mode)
    return model


def checkpointed_modules(model: nn.Module) -> list[str]:
    """Qualified names of the modules of ``model`` whose forward is checkpointed."""
    return [name for name, m in model.named_modules() if _is_checkpointed(m)]


def remove_checkpointing(model: nn.Module) -> nn.Module:
    """Undo ``checkpoint_layers``: restore the class forward of every checkpointed module. Returns ``model``."""
    for _, module in model.named_modules():
        if _is_checkpointed(module):
            del module.__dict__["forward"]
    return model


@contextlib.contextmanager
def _checkpointing_enabled(model: nn.Module, enabled: bool) -> Iterator[None]:
    wrappers = [m.__dict__["forward"] for _, m in model.named_modules() if _is_checkpointed(m)]
    before = [w.enabled for w in wrappers]
    for w in wrappers:
        w.enabled = enabled
    try:
        yield
    finally:
        for w, state in zip(wrappers, before):
            w.enabled = state


def _count(meter: dict[int, torch.UntypedStorage], tensor: torch.Tensor) -> None:
    # Views share a storage (q, k, v are views of one qkv output): count each storage once, whole.
    storage = tensor.untyped_storage()
    meter.setdefault(storage.data_ptr(), storage)


def activation_memory(model: nn.Module, fn: Callable[[], Any]) -> int:
    """Bytes kept alive for backward by running ``fn()`` (typically the forward pass and loss of ``model``).

    Counts the unique storages that autograd saves for backward during ``fn()`` (through
    ``torch.autograd.graph.saved_tensors_hooks``) plus the inputs that checkpointed modules keep by
    reference, excluding ``model``'s parameters (they are alive anyway). Tensors saved inside a
    checkpointed region are not kept (they are recomputed) and are not counted. Does not run backward;
    the graph built by ``fn()`` is freed when its result is dropped.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    meter: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        _count(meter, t)
        return t

    token, caches = _METER.set(meter), _CACHES.set([])
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = fn()  # held until counted: its graph owns the saved tensors
        for store in _CACHES.get():
            for outputs in store.values():
                for t in tree_flatten(list(outputs.values()))[0]:
                    t = getattr(t, "val", t)  # torch wraps each cached output (its version counter checked)
                    if isinstance(t, torch.Tensor):
                        _count(meter, t)
    finally:
        _METER.reset(token)
        _CACHES.reset(caches)
    total = sum(storage.nbytes() for ptr, storage in meter.items() if ptr not in params)
    del result, meter
    return total


@dataclass(frozen=True)
class ActivationReport:
    """Activation bytes of one forward pass with and without the model's checkpointing."""

    with_checkpointing: int
    """Bytes kept for backward with the checkpointing applied by ``checkpoint_layers``."""
    without_checkpointing: int
    """Bytes kept for backward with every checkpointed module running normally."""
    checkpointed: tuple[str, ...]
    """Names of the checkpointed modules."""

    @property
    def saved_bytes(self) -> int:
        return self.without_checkpointing - self.with_checkpointing

    def __str__(self) -> str:
        ratio = self.with_checkpointing / max(1, self.without_checkpointing)
        return (f"activations: {self.without_checkpointing / 2**20:.2f} MiB without checkpointing, "
                f"{self.with_checkpointing / 2**20:.2f} MiB with ({len(self.checkpointed)} modules checkpointed): "
                f"{self.saved_bytes / 2**20:.2f} MiB saved ({ratio:.0%} kept)")


def checkpoint_report(model: nn.Module, fn: Callable[[], Any]) -> ActivationReport:
    """Measure ``activation_memory(model, fn)`` with the model's checkpointing on, then off.

    ``model`` must already be wrapped by ``checkpoint_layers``; ``fn`` runs one forward (and loss), e.g.
    ``lambda: lm_loss(model(idx), targets)``. ``fn`` runs twice; with dropout, seed it inside ``fn``.
    """
    names = tuple(checkpointed_modules(model))
    if not names:
        raise ValueError("checkpoint_report needs a model wrapped by checkpoint_layers (no module is checkpointed); "
                         "call checkpoint_layers(model) first")
    with _checkpointing_enabled(model, True):
        on = activation_memory(model, fn)
    with _checkpointing_enabled(model, False):
        off = activation_memory(model, fn)
    return ActivationReport(with_checkpointing=on, without_checkpointing=off, checkpointed=names)
