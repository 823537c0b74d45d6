"""Models built on the meta device, materialised per rank: each meta parameter carries a *source* that produces
any block of its full value (its initial values, or a pretrained file's bytes), and every strategy reads only
what its rank keeps.

    with torch.device("meta"):
        model = MyModel(cfg)            # names and shapes only, nothing allocated
    model, opt = sw.zero(model, mesh, stage=3, optimizer=...)   # each rank draws only its flat shard

A source is any object with ``shape``, ``dtype``, ``read(index=None)`` (a block of the full value: ``index`` a
tuple of slices, one per leading dim, ``None`` for all of it) and ``read_flat(start, stop)`` (elements
``[start, stop)`` of the flattened value); both return CPU tensors in ``dtype``. ``ensure_sources`` gives every
meta tensor without one its initial-value source:

* the model's ``param_init(name) -> Normal | Uniform | Constant`` (``init_rules.py``) with the model's
  ``init_seed`` attribute (else ``torch.initial_seed()``): layout-independent values, a rank draws only its
  elements;
* else the owning module's ``reset_parameters()`` — or the root's ``_init_weights(module)``, as a Hugging Face
  model has — run on a CPU copy under an RNG seeded from (seed, module name): layout-independent too, one module
  in flight, but it draws the module whole.

``materialize`` replaces a module's remaining meta tensors by their full values on a device; the parameter
*objects* stay the same (``torch.utils.swap_tensors``), so tied weights stay tied. Local: nothing here
communicates.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterator, Protocol

import torch
from torch import nn

from ...mesh import Mesh
from .expert_tag import is_expert_param
from .init_rules import InitRule, block_seed, draw

__all__ = ["needs_broadcast", "mark_drawn", "Source", "InitSource", "ModuleResetSource", "SliceSource", "deferred_piece", "source_of", "set_source", "ensure_sources",
           "materialize", "swap_in", "materialize_model", "draw_seed", "init_from_rules", "read_full", "read_flat", "flat_from_rows", "has_meta", "meta_tensors", "rows_then_index"]

_ATTR = "_shardwise_source"


class Source(Protocol):
    """Where a meta tensor's values come from (see the module docstring)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor: ...

    def read_flat(self, start: int, stop: int) -> torch.Tensor: ...


_DRAWN = "_shardwise_drawn"


def needs_broadcast(t: torch.Tensor) -> bool:
    """Whether replicas must copy coordinate 0's ``t``: not when it is meta (each rank reads it from its source)
    or was drawn from one (every rank drew the same values), nor when it is an expert-parallel piece (each rank
    holds other experts: ``expert_tag``)."""
    return not t.is_meta and not getattr(t, _DRAWN, False) and not is_expert_param(t)


def mark_drawn(t: torch.Tensor) -> torch.Tensor:
    setattr(t, _DRAWN, True)
    return t


def source_of(t: torch.Tensor) -> Source | None:
    return getattr(t, _ATTR, None)


def set_source(t: torch.Tensor, source: Source) -> None:
    """Attach ``source`` to the meta tensor ``t`` (replacing any earlier one: a pretrained file over init)."""
    if tuple(source.shape) != tuple(t.shape):
        raise ValueError(f"source of shape {tuple(source.shape)} for a tensor of shape {tuple(t.shape)}")
    setattr(t, _ATTR, source)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def flat_from_rows(read_rows: Callable[[int, int], torch.Tensor], shape: tuple[int, ...], start: int,
                   stop: int) -> torch.Tensor:
    """Elements ``[start, stop)`` of a tensor of ``shape`` (≥ 1-D) that reads whole rows (``read_rows(first,
    stop)``): only the rows covering the range are read, then cut (a fresh tensor)."""
    row = _numel(tuple(shape[1:]))
    stop = max(start, stop)
    first, last = start // row, -(-stop // row)
    block = read_rows(first, last).reshape(-1)
    cut = block[start - first * row:stop - first * row]
    return cut.clone() if cut.numel() < block.numel() else cut.contiguous()


def rows_then_index(read_flat: Callable[[int, int], torch.Tensor], shape: tuple[int, ...],
                    index: tuple[slice, ...] | None) -> torch.Tensor:
    """A block of a tensor that can only be read as flat ranges: the rows ``index[0]`` selects (a contiguous
    flat range: only those rows are read), then ``index[1:]`` applied to them."""
    if not shape:
        return read_flat(0, 1).view(())
    index = tuple(index or ())
    rows = index[0] if index else slice(None)
    a, b, step = rows.indices(int(shape[0]))
    if step != 1:
        raise ValueError(f"row slices must have step 1, got {rows}")
    b = max(a, b)
    row = _numel(tuple(shape[1:]))
    block = read_flat(a * row, b * row).view(b - a, *shape[1:])
    return block[(slice(None), *index[1:])] if len(index) > 1 else block


class InitSource:
    """Initial values by rule (``init_rules``): ``(seed, key)`` decides every element."""

    def __init__(self, key: str, rule: InitRule, seed: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.key, self.rule, self.seed = key, rule, int(seed)
        self.shape, self.dtype = tuple(int(s) for s in shape), dtype

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        return draw(self.rule, self.seed, self.key, _numel(self.shape), start, stop, self.dtype)

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        return rows_then_index(self.read_flat, self.shape, index)

    def __repr__(self) -> str:
        return f"InitSource({self.key!r}, {self.rule}, seed={self.seed})"


def _reset(module: nn.Module) -> None:
    module.reset_parameters()  # type: ignore[operator]


class ModuleResetSource:
    """A parameter's (or buffer's) value from an initialiser run on a CPU copy of its module — the module's
    ``reset_parameters()``, or the root model's ``_init_weights(module)`` (Hugging Face's convention, which also
    recomputes rotary ``inv_freq`` buffers) — the RNG seeded from ``(seed, module name)``. The last module's
    values are cached (its other tensors read them next)."""

    _cache: tuple[tuple, dict[str, torch.Tensor]] | None = None
    """(key, values) of the last module drawn. The key holds the module itself, not its ``id`` — an id is reused
    once a module is freed, and a stale hit would hand one module's values to another."""

    def __init__(self, module: nn.Module, module_name: str, attr: str, seed: int, shape: tuple[int, ...],
                 dtype: torch.dtype, init: Callable[[nn.Module], None] = _reset) -> None:
        self.module, self.module_name, self.attr, self.seed = module, module_name, attr, int(seed)
        self.shape, self.dtype, self.init = tuple(int(s) for s in shape), dtype, init

    def _values(self) -> dict[str, torch.Tensor]:
        key = (self.module, self.module_name, self.seed, self.init)
        cached = ModuleResetSource._cache
        if cached is not None and len(cached[0]) == len(key) and all(a is b or a == b for a, b in zip(cached[0], key)):
            return cached[1]
        tmp = copy.deepcopy(self.module).to_empty(device="cpu", recurse=True)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(block_seed(self.seed, self.module_name, 0))
            with torch.no_grad():
                self.init(tmp)
        values = {n: t.detach() for n, t in [*tmp.named_parameters(recurse=False), *tmp.named_buffers(recurse=False)]}
        ModuleResetSource._cache = (key, values)
        return values

    @staticmethod
    def release() -> None:
        """Drop the cached module values (called when a materialisation is done: they are one module's copy)."""
        ModuleResetSource._cache = None

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        value = self._values()[self.attr].to(self.dtype)
        return value if index is None else value[index]

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        return self._values()[self.attr].reshape(-1)[start:stop].to(self.dtype)


class SliceSource:
    """The values of a tensor-parallel piece of a meta parameter, read from the full parameter's source only when
    the piece is materialised (by whichever wrapper comes last: ZeRO-3 reads flat ranges of it, a pipeline only
    its own stages' pieces). The piece is ``cat(full[r : r + n, cols] for r, n in segments)`` along dim 0: one
    segment for a row (dim-0) split, one with a column range for a dim-1 split, one per fused chunk for heads;
    a transposed fused projection's heads: one segment and one column range per chunk, concatenated on dim 1."""

    def __init__(self, full: Source, segments: list[tuple[int, int]],
                 cols: tuple[int, int] | list[tuple[int, int]] | None, seed: int | None = None) -> None:
        # cols: one [a, b) column range, or a list of them concatenated (a transposed fused projection's heads)
        self.full, self.segments = full, segments
        self.cols = [cols] if isinstance(cols, tuple) else cols
        rest = tuple(full.shape[1:])
        if self.cols is not None:
            rest = (sum(b - a for a, b in self.cols), *rest[1:])
        self.shape: tuple[int, ...] = (sum(n for _, n in segments), *rest)
        self.dtype = full.dtype
        self.seed = getattr(full, "seed", seed)

    def _rows(self, first: int, stop: int) -> torch.Tensor:
        """Rows ``[first, stop)`` of the piece, each from its segment of the full tensor."""
        parts, at = [], 0
        for start, n in self.segments:
            a, b = max(first, at), min(stop, at + n)
            if a < b:
                rows = slice(start + a - at, start + b - at)
                if self.cols is None:
                    parts.append(self.full.read((rows,)))
                else:
                    spans = [self.full.read((rows, slice(c0, c1))) for c0, c1 in self.cols]
                    parts.append(spans[0] if len(spans) == 1 else torch.cat(spans, dim=1))
            at += n
        if not parts:
            return torch.empty((0, *self.shape[1:]), dtype=self.dtype)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def read_flat(self, start: int, stop: int) -> torch.Tensor:
        return flat_from_rows(self._rows, self.shape, start, stop)

    def read(self, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        return rows_then_index(self.read_flat, self.shape, index)


def meta_tensors(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor]]:
    """``(qualified name, owner module, attribute, tensor)`` of every meta parameter and buffer, each tensor once
    (a tied one under its first name)."""
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for kind in ("_parameters", "_buffers"):
            for attr, t in getattr(module, kind).items():
                if t is None or not t.is_meta or id(t) in seen:
                    continue
                seen.add(id(t))
                yield (f"{mod_name}.{attr}" if mod_name else attr), module, attr, t


def has_meta(model: nn.Module) -> bool:
    return next(meta_tensors(model), None) is not None


def ensure_sources(model: nn.Module, seed: int | None = None) -> int:
    """Give every meta tensor of ``model`` that has no source its initial-value source (see the module
    docstring); names are ``model``'s qualified names, so call it on the root model, before wrapping. Returns
    how many were given one. Raises ``ValueError`` naming a tensor nothing can initialise. Local."""
    seed = int(seed if seed is not None else getattr(model, "init_seed", None) or torch.initial_seed())
    rule_of = getattr(model, "param_init", None)
    root_init = getattr(model, "_init_weights", None)  # a Hugging Face model initialises any of its modules
    count = 0
    for name, module, attr, t in meta_tensors(model):
        if source_of(t) is not None:
            continue
        rule = rule_of(name) if callable(rule_of) else None
        if rule is not None:
            set_source(t, InitSource(name, rule, seed, tuple(t.shape), t.dtype))
        elif callable(getattr(module, "reset_parameters", None)) or callable(root_init):
            init = _reset if callable(getattr(module, "reset_parameters", None)) else root_init
            set_source(t, ModuleResetSource(module, name.rpartition(".")[0], attr, seed, tuple(t.shape), t.dtype,
                                            init))
        else:
            raise ValueError(
                f"{name!r} {tuple(t.shape)} is on the meta device and nothing says how to initialise it: give "
                f"{type(model).__name__} a param_init(name) method returning sw.Normal/Uniform/Constant for "
                f"it, give {type(module).__name__} a reset_parameters(), or load its values "
                f"(sw.load_pretrained(model, directory))")
        count += 1
    return count


def _source(name: str, t: torch.Tensor) -> Source:
    src = source_of(t)
    if src is None:
        raise ValueError(f"{name!r} is on the meta device without a source of values; build the model on meta "
                         f"and pass the root model to the shardwise wrapper (it calls ensure_sources), or call "
                         f"shardwise.parallel.common.materialize.ensure_sources(model) first")
    return src


def read_full(t: torch.Tensor, device: torch.device | str, name: str = "?") -> torch.Tensor:
    """The full value of ``t`` on ``device`` (``t`` itself, detached, when it is not meta)."""
    if not t.is_meta:
        return t.detach()
    return _source(name, t).read().to(device)


def read_flat(t: torch.Tensor, start: int, stop: int, device: torch.device | str, name: str = "?") -> torch.Tensor:
    """Elements ``[start, stop)`` of ``t`` flattened (read from its source when meta)."""
    if not t.is_meta:
        return t.detach().reshape(-1)[start:stop]
    return _source(name, t).read_flat(start, stop).to(device)


def swap_in(t: torch.Tensor, new: torch.Tensor) -> None:
    """Make the (meta) tensor object ``t`` hold ``new``'s data, keeping ``t``'s Python attributes (SBP
    annotations, head layouts; not its source): every module, tie and hook holding ``t`` then sees the value."""
    for k, v in vars(t).items():
        if k != _ATTR:
            setattr(new, k, v)
    torch.utils.swap_tensors(t, new)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device | str) -> int:
    """Replace every meta parameter and buffer of ``model`` by its full value on ``device``, keeping parameter
    objects (ties, hooks and attributes hold). Tensors that are not meta are left as they are. Returns the bytes
    materialised. Local."""
    total = 0
    for name, module, attr, t in list(meta_tensors(model)):
        value = _source(name, t).read().to(device)
        if attr in module._parameters:
            swap_in(t, mark_drawn(nn.Parameter(value, requires_grad=t.requires_grad)))
        else:
            for owner in model.modules():  # a buffer is a plain tensor: re-register it wherever it sits
                for key, b in list(owner._buffers.items()):
                    if b is t:
                        owner._buffers[key] = mark_drawn(value)
        total += value.numel() * value.element_size()
    ModuleResetSource.release()
    return total



def draw_seed() -> int:
    """A model's ``init_seed``: one draw from torch's global CPU generator (so ``torch.manual_seed(s)`` before
    construction decides it, on the meta device as on a real one)."""
    return int(torch.randint(0, 2**62, (), device="cpu", dtype=torch.int64))


@torch.no_grad()
def init_from_rules(model: nn.Module, seed: int) -> None:
    """Fill every (non-meta) parameter of ``model`` with its ``model.param_init(name)`` rule's values under
    ``seed`` — exactly what a sharded layout draws for its pieces. Meta tensors are left for ``ensure_sources``.
    Local."""
    rule_of = getattr(model, "param_init")
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta or id(t) in seen:
            continue
        seen.add(id(t))
        rule = rule_of(name)
        if rule is not None:
            t.copy_(draw(rule, seed, name, t.numel(), 0, t.numel(), t.dtype).view(t.shape))


def materialize_model(model: nn.Module, where: "torch.device | str | Mesh") -> nn.Module:
    """``sw.materialize``: every meta parameter and buffer of ``model`` given its values on ``where`` (a device, or
    a mesh: its device) — the initial values any layout draws, or the pretrained values attached
    (``sw.load_pretrained``). For a model used as it is after ``sw.parallelize`` (no ZeRO, DataParallel or
    pipeline wrapper, which materialise themselves), and for the one-device reference of a meta-built model.
    Returns ``model``. Local."""
    device = where.device if isinstance(where, Mesh) else torch.device(where)
    ensure_sources(model)
    materialize(model, device)
    return model


def deferred_piece(full: torch.Tensor, segments: list[tuple[int, int]],
                   cols: tuple[int, int] | list[tuple[int, int]] | None) -> nn.Parameter:
    """A meta parameter for a piece of the meta parameter ``full`` (see ``SliceSource``): nothing is read until the
    piece is materialised. ``full`` must have a source (``ensure_sources``)."""
    src = source_of(full)
    if src is None:
        raise ValueError(f"a meta parameter of shape {tuple(full.shape)} has no source of values; call "
                         f"ensure_sources(model) on the root model first")
    piece = SliceSource(src, segments, cols)
    p = nn.Parameter(torch.empty(piece.shape, dtype=full.dtype, device="meta"), requires_grad=full.requires_grad)
    set_source(p, piece)
    return p
