"""Cut a model into pipeline stages: an ordered list of units, grouped into contiguous stages.

A **unit** is the smallest piece a stage boundary can fall between: a callable ``Tensor -> Tensor`` plus the
named modules whose parameters it uses. How a model becomes units (``model_units``):

* ``nn.Sequential``: one unit per child, named after the child (``"0"``, ``"1"``, ... or its given name).
* a model that knows its own cut points (``PipelineCuttable``: it has ``pipeline_units()``), such as the
  reference ``GPT`` (``shardwise.models.gpt``, cut at block boundaries): the units it returns.
* any other model with a ``blocks`` ``nn.ModuleList``: the children registered before ``blocks`` are applied
  one after the other as the first unit, each block is a unit, the children after ``blocks`` are applied in
  order as the last unit. This is right only when the model's ``forward`` is that plain chain.

A boundary is named by the unit that starts the next stage (``split=["blocks.2", "ln_f"]``). Without ``split``
the units are balanced by **parameter count**: the contiguous partition into ``n`` non-empty stages whose
largest stage has the fewest parameters (a tied parameter counts in every unit that uses it, since each
stage that uses it holds a copy). Pure: no communication here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..common.selective import check_mode, checkpoint_kwargs, has_attention

__all__ = ["Unit", "PipelineCuttable", "Stage", "model_units", "balance_by_params", "resolve_split", "build_stages"]


@dataclass(frozen=True)
class Unit:
    """One indivisible piece of the model: ``fn(x)`` using the parameters of ``modules``."""

    name: str
    """Name of the unit's first module in the original model (``"blocks.3"``); boundaries use it."""
    fn: Callable[[Tensor], Tensor]
    modules: tuple[tuple[str, nn.Module], ...]
    """(qualified name in the original model, module) pairs whose parameters and buffers the unit uses."""

    def num_params(self) -> int:
        seen = {id(p): p.numel() for _, m in self.modules for p in m.parameters()}
        return sum(seen.values())


@runtime_checkable
class PipelineCuttable(Protocol):
    """A model that says where it may be cut: its ``forward`` must equal running ``pipeline_units()`` in order.

    The model carries this knowledge (it alone knows what its ``forward`` does between submodules); the
    pipeline only asks, so ``shardwise.parallel`` never imports a model class."""

    def pipeline_units(self) -> Sequence[Unit]:
        """The ordered units; boundaries of ``split`` name them."""
        ...


def _chain(mods: Sequence[nn.Module]) -> Callable[[Tensor], Tensor]:
    def run(x: Tensor) -> Tensor:
        for mod in mods:
            x = mod(x)
        return x
    return run


def model_units(model: nn.Module) -> list[Unit]:
    """The ordered units of ``model`` (see module doc); ``TypeError`` for a model of no supported shape."""
    if isinstance(model, PipelineCuttable):
        return list(model.pipeline_units())
    if isinstance(model, nn.Sequential):
        # _modules, not named_children(): a module listed twice runs twice (named_children skips repeats)
        return [Unit(name, child, ((name, child),)) for name, child in model._modules.items() if child is not None]
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList):
        children = list(model.named_children())
        at = next(i for i, (n, _) in enumerate(children) if n == "blocks")
        pre, post = children[:at], children[at + 1:]
        units = [Unit(pre[0][0], _chain([m for _, m in pre]), tuple(pre))] if pre else []
        units += [Unit(f"blocks.{i}", b, ((f"blocks.{i}", b),)) for i, b in enumerate(blocks)]
        if post:
            units.append(Unit(post[0][0], _chain([m for _, m in post]), tuple(post)))
        return units
    raise TypeError(f"sw.pipeline without example_inputs needs an nn.Sequential or a model with a 'blocks' "
                    f"nn.ModuleList, got {type(model).__name__}; pass example_inputs= (one micro-batch) to capture "
                    f"any model's forward and cut it at named modules, or wrap the layers in nn.Sequential(...)")


def balance_by_params(weights: Sequence[int], n: int) -> list[int]:
    """Start indices of ``n`` contiguous non-empty parts of ``weights`` minimising the heaviest part.

    Dynamic programming over (parts, prefix): O(n * len^2), fine for hundreds of units. Ties keep the
    earliest boundaries, so the result is deterministic on every rank.
    """
    k = len(weights)
    assert 1 <= n <= k
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[j][i]: the smallest max-part weight splitting weights[:i] into j parts; cut[j][i]: last start
    best = [[inf] * (k + 1) for _ in range(n + 1)]
    cut = [[0] * (k + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for j in range(1, n + 1):
        for i in range(j, k + 1):
            for s in range(j - 1, i):
                cost = max(best[j - 1][s], prefix[i] - prefix[s])
                if cost < best[j][i]:
                    best[j][i], cut[j][i] = cost, s
    starts, i = [], k
    for j in range(n, 0, -1):
        i = cut[j][i]
        starts.append(i)
    return starts[::-1]


def resolve_split(units: Sequence[Unit], split: Sequence[str]) -> list[int]:
    """Unit start indices (always beginning with 0) for boundary names; ``ValueError`` on bad names."""
    index = {u.name: i for i, u in enumerate(units)}
    inner = {name: u.name for u in units for name, _ in u.modules}
    starts = [0]
    for name in split:
        if name not in index:
            hint = (f"{name!r} is inside unit {inner[name]!r}, which cannot be cut" if name in inner
                    else f"{name!r} names no module of the model")
            raise ValueError(f"pipeline split {list(split)}: {hint}; a boundary must name the unit that starts a "
                             f"stage, one of {[u.name for u in units[1:]]}")
        starts.append(index[name])
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError(f"pipeline split {list(split)} leaves a stage empty: boundaries must be distinct units "
                         f"in model order after the first unit {units[0].name!r}; units are "
                         f"{[u.name for u in units]}")
    return starts


class Stage(nn.Module):
    """Stage ``index``: units ``[start, stop)`` of the model, run one after the other."""

    def __init__(self, index: int, units: Sequence[Unit]) -> None:
        super().__init__()
        self.index = index
        self.units = list(units)
        # Registered under the original qualified names (dots -> '/' since module names cannot hold dots), so
        # parameters() finds them; original keys come from ``owned_names``.
        self.parts = nn.ModuleDict({name.replace(".", "/"): m for u in units for name, m in u.modules})
        self.checkpoint = "none"
        """Activation checkpointing (``none``, ``full``, ``selective``): ``full``, each unit keeps only its input and
        recomputes its activations in backward (``torch.utils.checkpoint``, non-reentrant: recomputed inside the
        same backward, hooks fire once); ``selective``, each unit with an attention module keeps its weight
        matmuls' outputs and recomputes the rest (``parallel/common/selective.py``)."""
        self.unit_hook: Any = None
        """ZeRO-3 (``zero3.PipelineStage3``): told before and after each unit runs, to gather and free it."""

    def forward(self, x: Tensor) -> Tensor:
        mode = check_mode(self.checkpoint)  # True/False, as the attribute once was, mean full/none
        hook = self.unit_hook
        for k, u in enumerate(self.units):
            if hook is not None:
                hook.before(self.index, k)
            # float inputs only: the embedding unit's token ids have nothing to recompute from
            if (mode != "none" and torch.is_grad_enabled() and x.is_floating_point()
                    and (mode == "full" or any(has_attention(m) for _, m in u.modules))):
                x = checkpoint(u.fn, x, use_reentrant=False, **checkpoint_kwargs(mode))
            else:
                x = u.fn(x)
            if hook is not None:
                hook.after(self.index, k, x)
        return x

    def owned_names(self) -> list[str]:
        """Qualified names (in the original model) of the modules this stage runs."""
        return [name for u in self.units for name, _ in u.modules]


def build_stages(model: nn.Module, n: int, split: Sequence[str] | None) -> list[Stage]:
    """All ``n`` stages of ``model`` (every rank builds all of them, keeps its own); pure, raises
    ``ValueError`` for a bad split or too few units."""
    units = model_units(model)
    if split is not None:
        if isinstance(split, str):
            raise TypeError(f"split must be a list of unit names, got the string {split!r}; use [{split!r}]")
        starts = resolve_split(units, split)
        if len(starts) != n:
            raise ValueError(f"pipeline split {list(split)} makes {len(starts)} stages but the mesh axis and chunks "
                             f"need pp x chunks = {n}; give {n - 1} boundaries")
    else:
        if len(units) < n:
            raise ValueError(f"the model has {len(units)} pipeline units ({[u.name for u in units]}) but "
                             f"pp x chunks = {n} stages need at least {n}; use fewer stages or more blocks")
        starts = balance_by_params([u.num_params() for u in units], n)
    bounds = list(zip(starts, starts[1:] + [len(units)]))
    return [Stage(i, units[a:b]) for i, (a, b) in enumerate(bounds)]
