"""Regional compilation: ``sw.compile(model)`` compiles each repeated unit (transformer block) on its own.

Why regional (as torchtitan does) and not the whole model: the blocks of a model share one forward, so one
compiled graph serves every block (compile time of one block, not of n); and everything shardwise does *around*
a block — ZeRO-3's gather/free hooks, data parallelism's gradient hooks, activation checkpointing, pipeline
stages, the tensor-parallel RNG and input bookkeeping at the root — stays ordinary eager Python.

How: the block's instance ``forward`` is replaced by a ``Region`` that calls ``torch.compile`` of the class
forward with the block as an argument (``nn.Module.__call__`` and its hooks are untouched, so parameter names,
``state_dict`` keys and every module hook stay as they are). A block already wrapped by activation checkpointing
(``checkpoint_layers``) keeps its checkpoint wrapper, which now calls the compiled forward: checkpoint outside,
compile inside — the recomputation in backward runs the compiled graph again.

Submodules inside a block that communicate or keep Python state per call — shardwise's tensor-parallel layers
(collectives in custom autograd functions, the shared-input cache, RNG streams) and any submodule with hooks
(sequence parallelism's gradient regions, ZeRO units finer than a block) — are *opaque*: each such call is one
clean graph break and runs eagerly, so the collectives run exactly as in eager mode (same count, same order).
Apply ``sw.compile`` last, after ``parallelize``, ``checkpoint_layers``, ``DataParallel`` and ``zero``: hooks
added to a block's submodules later would be traced into the graph.

Recompilation: each region counts the graphs compiled during its calls. A compilation during a call after the
region's first call with the same grad mode and train/eval state is a *recompile*: counted, and warned about once
per region with what changed in its inputs (``CompileStats``). Nothing here communicates.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch import nn

__all__ = ["compile", "CompileStats", "compile_stats", "compiled_regions", "default_regions"]

REGION_ATTR = "_shardwise_compiled_region"
"""Set to True on every compiled region (a pipeline's zero-bubble weight capture skips such modules)."""
_STATE_ATTR = "_shardwise_compile"


@dataclass
class CompileStats:
    """What compiling a model cost and how often it recompiled. ``compile_s``, ``graphs`` and ``graph_breaks``
    are this process's dynamo totals since ``sw.compile`` (every compiled function of the process counts);
    ``recompiles`` and ``reasons`` are this model's regions only."""

    regions: int = 0
    """Modules compiled (transformer blocks)."""
    compile_s: float = 0.0
    """Seconds dynamo and the backend spent compiling (forward graphs, and backward graphs compiled lazily)."""
    graphs: int = 0
    """Graphs compiled (a graph break splits a region into several; each tensor-parallel layer is one)."""
    graph_breaks: int = 0
    """Graph breaks dynamo met (the opaque submodules' calls among them)."""
    recompiles: int = 0
    """Compilations after a region's first call in the same mode (grad on/off, train/eval)."""
    reasons: list[str] = field(default_factory=list)
    """One line per recompile: the region and what changed in its inputs."""


def _dynamo_totals() -> tuple[float, int, int]:
    """``(compile seconds, graphs, graph breaks)`` of this process so far (dynamo's own counters)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    seconds = sum(compilation_time_metrics.get("_compile.compile_inner", []))
    seconds += sum(sum(v) for k, v in compilation_time_metrics.items() if k.endswith("bw_compiler"))
    return seconds, int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _graphs_now() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class _State:
    """A compiled model's bookkeeping: dynamo totals at ``sw.compile``, its regions' recompiles."""

    def __init__(self, regions: int) -> None:
        self.regions = regions
        self.base = _dynamo_totals()
        self.reasons: list[str] = []
        self.listeners: list[Callable[[str], None]] = []

    def stats(self) -> CompileStats:
        now = _dynamo_totals()
        return CompileStats(regions=self.regions, compile_s=now[0] - self.base[0], graphs=now[1] - self.base[1],
                            graph_breaks=now[2] - self.base[2], recompiles=len(self.reasons),
                            reasons=list(self.reasons))


def _signature(args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, str]:
    """What a region's guards most often depend on, as readable strings: the tensor inputs' shapes, dtypes and
    ``requires_grad``, and autocast."""
    sig = {"autocast": str(torch.is_autocast_enabled())}
    for name, value in [*enumerate(args), *kwargs.items()]:
        if isinstance(value, torch.Tensor):
            sig[f"input {name}"] = f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}" + (
                " requires_grad" if value.requires_grad else "")
    return sig


class Region:
    """A compiled block's forward (the block's instance ``forward``, or the body of its checkpoint wrapper).
    Calls ``fn(module, *args)``; counts the graphs compiled during each call (see module docstring)."""

    def __init__(self, module: nn.Module, name: str, fn: Callable[..., Any], state: _State) -> None:
        self.module, self.name, self.fn, self.state = module, name, fn, state
        self.seen: dict[tuple[bool, bool], dict[str, str]] = {}  # (grad mode, training) -> last signature
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = (torch.is_grad_enabled(), self.module.training)
        before = _graphs_now()
        out = self.fn(self.module, *args, **kwargs)
        if key not in self.seen or _graphs_now() != before:  # first call in this mode, or a recompile
            sig = _signature(args, kwargs)
            if key in self.seen:
                self._recompiled(self.seen[key], sig)
            self.seen[key] = sig
        return out

    def _recompiled(self, old: dict[str, str], new: dict[str, str]) -> None:
        changed = [f"{k}: {old.get(k, '-')} -> {new.get(k, '-')}" for k in sorted(set(old) | set(new))
                   if old.get(k) != new.get(k)]
        why = "; ".join(changed) or ("a guard on module or global state failed (run with TORCH_LOGS=recompiles "
                                     "for dynamo's reason)")
        reason = f"{self.name} recompiled ({why})"
        self.state.reasons.append(reason)
        for listener in self.state.listeners:
            listener(reason)
        if not self.warned:
            self.warned = True
            warnings.warn(f"sw.compile: {reason}; each recompilation costs a compile — keep input shapes and "
                          f"dtypes fixed between steps", RuntimeWarning, stacklevel=2)


class _Eager:
    """A submodule call kept out of the compiled graph (hooks and forward run eagerly): one graph break. Set as
    the module's ``_compiled_call_impl``, which ``nn.Module.__call__`` prefers; a callable object rather than a
    bound method so that copying the module copies the reference to the copy."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _eager_call()(self.module, *args, **kwargs)


def _call(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return module._call_impl(*args, **kwargs)


_disabled_call: list[Callable[..., Any]] = []


def _eager_call() -> Callable[..., Any]:
    """``_call`` behind ``torch._dynamo.disable`` (made at first use: importing dynamo costs seconds)."""
    if not _disabled_call:
        import torch._dynamo

        _disabled_call.append(torch._dynamo.disable(_call, reason="shardwise: runs eagerly (collectives, hooks)"))
    return _disabled_call[0]


_compiled: dict[tuple, Callable[..., Any]] = {}
"""One ``torch.compile`` wrapper per (class forward, options): blocks of one class share their graphs."""


def _compiled_forward(cls: type, backend: Any, mode: str | None, fullgraph: bool, dynamic: bool | None,
                      options: dict[str, Any] | None) -> Callable[..., Any]:
    key = (cls.forward, backend, mode, fullgraph, dynamic, tuple(sorted((options or {}).items())))
    if key not in _compiled:
        if backend == "inductor":  # mode and options as torch.compile gives them to inductor
            inner = torch._TorchCompileInductorWrapper(mode, options, dynamic)
        else:
            from torch._dynamo import lookup_backend

            inner = backend if callable(backend) else lookup_backend(backend)
        _compiled[key] = torch.compile(cls.forward, backend=_KeepBuffers(inner), fullgraph=fullgraph,
                                       dynamic=dynamic)
    return _compiled[key]


class _KeepBuffers:
    """A backend compiling with AOTAutograd's donated buffers off: a donated buffer is freed by the first
    backward, but a pipeline's zero-bubble split differentiates a stage twice (``retain_graph=True``: B, then W),
    as can user code. Costs the saved activations' memory reuse in backward only."""

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        from torch._functorch import config

        with config.patch(donated_buffer=False):
            return self.inner(gm, example_inputs, **kwargs)

    def __getattr__(self, name: str) -> Any:  # get_compiler_config, reset, ... of the wrapped backend
        return getattr(self.__dict__["inner"], name)


def default_regions(model: nn.Module) -> list[str]:
    """The elements of every outermost ``nn.ModuleList`` of ``model`` (``blocks.i`` of the GPT, ``model.layers.i``
    of an HF decoder): the repeated units. Pure."""
    lists = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    outer = [n for n in lists if not any(n.startswith(o + ".") for o in lists if o != n)]
    return [f"{n}.{i}" if n else str(i) for n in outer for i in range(len(model.get_submodule(n)))]


def _opaque(module: nn.Module) -> bool:
    """Whether a submodule of a region must run eagerly: shardwise's parallel layers (they communicate and keep
    state per call) and any module with hooks."""
    own = type(module).__module__.startswith(("shardwise.parallel.", "shardwise.comm."))
    hooked = bool(module._forward_pre_hooks or module._forward_hooks or module._backward_hooks
                  or module._backward_pre_hooks)
    return own or hooked


def _check_backend(backend: Any) -> None:
    if callable(backend):
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"unknown torch.compile backend {backend!r}; choose one of {sorted(known)} "
                         f"(e.g. 'inductor', or 'aot_eager' to trace without generating code)")


def compile(model: nn.Module, *, backend: str | Callable[..., Any] = "inductor", mode: str | None = None,
            fullgraph: bool = False, dynamic: bool | None = False, regions: Sequence[str] | None = None,
            options: dict[str, Any] | None = None) -> nn.Module:
    """Compile ``model``'s regions in place with ``torch.compile`` and return ``model`` (names, ``state_dict``
    keys and hooks unchanged; see module docstring). Local: nothing communicates, compilation happens at each
    region's first call.

    ``regions``: qualified module names to compile (default ``default_regions``: every transformer block).
    ``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``: as ``torch.compile`` (``dynamic=False``:
    shapes are fixed in training; a new shape recompiles and is reported). ``fullgraph=True`` refuses regions
    with opaque submodules (tensor-parallel layers, hooked modules), which must break the graph.
    Raises ``ValueError`` for an unknown backend or region, for a model compiled twice, or when no region
    is found. Read the cost with ``compile_stats(model)``."""
    _check_backend(backend)
    if getattr(model, _STATE_ATTR, None) is not None:
        raise ValueError("sw.compile: this model is already compiled; compile the plain model once")
    modules = dict(model.named_modules())
    names = list(regions) if regions is not None else default_regions(model)
    missing = [n for n in names if n not in modules]
    if missing or not names:
        raise ValueError(f"sw.compile: regions {missing or names} name no module of {type(model).__name__}; "
                         f"pass regions=[...] of its submodule names, e.g. {default_regions(model)[:2] or ['layer']}")
    if fullgraph:
        opaque = [f"{n}.{s}" for n in names for s, m in modules[n].named_modules() if s and _opaque(m)]
        if opaque:
            raise ValueError(f"sw.compile(fullgraph=True): {opaque[:3]} must run eagerly (they communicate or carry "
                             f"hooks), which breaks the graph; use fullgraph=False")
    state = _State(len(names))
    for name in names:
        _compile_region(modules[name], name, _compiled_forward(type(modules[name]), backend, mode, fullgraph,
                                                              dynamic, options), state)
    object.__setattr__(model, _STATE_ATTR, state)  # not a submodule or parameter: state_dict unchanged
    return model


def _compile_region(module: nn.Module, name: str, fn: Callable[..., Any], state: _State) -> None:
    from .activation_checkpointing import _CheckpointedForward

    for _, sub in list(module.named_modules())[1:]:
        if _opaque(sub):
            sub._compiled_call_impl = _Eager(sub)
    region = Region(module, name, fn, state)
    wrapper = module.__dict__.get("forward")
    if isinstance(wrapper, _CheckpointedForward):
        wrapper.body = region  # checkpoint outside, compiled forward inside (recomputed in backward)
    elif wrapper is not None:
        raise ValueError(f"sw.compile: {name}.forward is replaced by {type(wrapper).__name__}; compile the class "
                         f"forward only (remove the replacement first)")
    else:
        module.forward = region
    setattr(module, REGION_ATTR, True)


def compile_stats(model: nn.Module) -> CompileStats:
    """``CompileStats`` of a model returned by ``sw.compile`` (zeros for one that was not). Local."""
    state = getattr(model, _STATE_ATTR, None)
    return state.stats() if state is not None else CompileStats()


def compiled_regions(model: nn.Module) -> list[str]:
    """Qualified names of ``model``'s compiled regions. Pure."""
    return [n for n, m in model.named_modules() if getattr(m, REGION_ATTR, False)]


def on_recompile(model: nn.Module, listener: Callable[[str], None]) -> None:
    """Call ``listener(reason)`` at each recompile of ``model``'s regions (the trainer's progress line)."""
    state = getattr(model, _STATE_ATTR, None)
    if state is not None:
        state.listeners.append(listener)

