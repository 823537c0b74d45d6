"""The search's candidates, made on demand: groups of candidates are bounded before single plans are made.

A group (``group_bounds.Group``: every plan of one ``(tp, pp, dp, recomputation, sequence parallelism,
micro-batch)``) has two bounds (``group_bounds``): ``group_bound``, which needs neither the stage split nor
memory, for every group when the pool is built, and ``group_least``, the exact least bound of its candidates
whose memory bound fits. Groups are *reached* in the order of the first: the second is computed (one ``Layout``
per ZeRO stage, no candidate made) and the group waits in a second heap on it; when it comes up there, the
group is *expanded*: its candidates are made and predicted in the order of their own bounds. A group whose
bound is no better than the K-th best prediction holds no plan of the top K and goes no further (at 1,024
devices for GPT-3: ~390 groups reached, a handful expanded). The first bound is loose where it matters: the
fast schedules of a group often do not fit (an interleaved pipeline holds many micro-batches) and what fits
is slow, which only the second sees.

The micro-batch early stop (``enumerate._MB_STOP``, as the exhaustive enumeration) is applied when a group is
reached, in the order of the first bound.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from .enumerate import (_MB_STOP, Candidate, Pool, Space, _expand_mb, _note, _schedule_options, layouts,
                        async_tp_of, note_mb_stop, variants)
from .group_bounds import Group, group_bound, group_least
from .hardware import Hardware
from .predict import _hardware_for
from .spec import ModelSpec

__all__ = ["Group", "LazyPool"]


@dataclass
class LazyPool:
    """The search's candidates (module doc): groups in the order of their first bound, reached groups in a heap
    on their second, candidates in a heap on theirs."""

    spec: ModelSpec
    hw: Hardware
    pins: dict[str, Any]
    space: Space
    budget: float
    runtime: str
    cache: dict
    groups: list[Group]
    regions: dict
    pool: Pool = field(default_factory=Pool)
    heap: list[tuple[float, int, Candidate]] = field(default_factory=list)
    next_group: int = 0
    reached: list[tuple[float, int, Group]] = field(default_factory=list)
    """Reached groups not yet expanded, as a heap on their least candidate bound."""
    fitting: dict[int, int] = field(default_factory=dict)
    """Per reached group (by ``order``): its candidates within the memory budget."""
    seq: Any = field(default_factory=itertools.count)
    stopped: set = field(default_factory=set)
    """Families ``(tp, pp, dp, ckpt, sp)`` with the micro-batches above which nothing fits."""

    @staticmethod
    def build(spec: ModelSpec, hw: Hardware, *, devices: int, global_batch: int, pins: dict[str, Any],
              space: Space, budget: float, runtime: str, cache: dict) -> "LazyPool":
        regions: dict = {}
        hw_d = _hardware_for(hw, devices, cache)
        groups: list[Group] = []
        for tp, pp, dp in layouts(spec, hw, devices=devices, global_batch=global_batch, pins=pins, regions=regions):
            per = global_batch // dp
            for ckpt, sp, mbs, zeros in variants(spec, tp=tp, pp=pp, dp=dp, per=per, pins=pins, space=space):
                for i, mb in enumerate(mbs):
                    options = _schedule_options(pp, per, mb, space, pins, len(spec.layers), ckpt)
                    if not options or not zeros:
                        continue
                    lb = group_bound(spec, hw_d, tp=tp, pp=pp, dp=dp, per=per, mb=mb, ckpt=ckpt, sp=sp, zeros=zeros,
                                     accum=min(a for _, _, a in options),
                                     precision=pins.get("precision", space.precision), runtime=runtime, cache=cache,
                                     cp=pins.get("cp", 1), async_tp=async_tp_of(pins, tp), ep=pins.get("ep", 1))
                    groups.append(Group(lb, len(groups), tp, pp, dp, per, mb, ckpt, sp, tuple(zeros),
                                        tuple(mbs[i + 1:]), len(options) * len(zeros)))
        groups.sort()
        return LazyPool(spec, hw_d, pins, space, budget, runtime, cache, groups, regions)

    @property
    def total(self) -> int:
        return sum(g.size for g in self.groups)

    def _bounds(self) -> tuple[float, float, float]:
        """The least bound of the next unreached group, reached group and candidate (inf: none left)."""
        g = self.groups[self.next_group].time_lb if self.next_group < len(self.groups) else math.inf
        return g, self.reached[0][0] if self.reached else math.inf, self.heap[0][0] if self.heap else math.inf

    def next_bound(self) -> float:
        """The least bound of anything not yet predicted (a group not expanded, or a candidate)."""
        return min(self._bounds())

    def pop(self) -> Candidate | None:
        """The candidate with the least bound, reaching and expanding groups whose bound is below it; None when
        empty. On a tie a group goes first (its candidates may tie the candidate)."""
        while True:
            g, r, c = self._bounds()
            if g < math.inf and g <= r and g <= c:
                self._reach(self.groups[self.next_group])
                self.next_group += 1
            elif r < math.inf and r <= c:
                self._expand(heapq.heappop(self.reached)[2])
            else:
                break
        if not self.heap:
            return None
        return heapq.heappop(self.heap)[2]

    def _reach(self, g: Group) -> None:
        family = (g.tp, g.pp, g.dp, g.ckpt, g.sp)
        if (family, g.mb) in self.stopped:
            return
        bound, least, fit = group_least(self.spec, self.hw, g, self.pins, self.space, self.budget, self.runtime,
                                        self.cache, self.regions)
        self.fitting[g.order] = fit
        if fit:
            heapq.heappush(self.reached, (bound, g.order, g))
        if least > _MB_STOP * self.budget and g.larger:
            # as the exhaustive enumeration: larger micro-batches of this family are over the budget too
            fresh = [mb for mb in g.larger if (family, mb) not in self.stopped]
            self.stopped.update((family, mb) for mb in fresh)
            if fresh:
                note_mb_stop(self.regions, tp=g.tp, pp=g.pp, dp=g.dp, ckpt=g.ckpt, mb=g.mb, skipped=fresh, least=least)

    def _expand(self, g: Group, pool: Pool | None = None) -> None:
        """``g``'s candidates into ``pool`` (default: the search's, onto the heap of those within the budget)."""
        into = pool if pool is not None else self.pool
        before = len(into.feasible)
        _expand_mb(self.spec, self.hw, into, self.regions, tp=g.tp, pp=g.pp, dp=g.dp, per=g.per, mb=g.mb,
                   ckpt=g.ckpt, sp=g.sp, zeros=list(g.zeros), pins=self.pins, space=self.space,
                   precision=self.pins.get("precision", self.space.precision), budget=self.budget,
                   runtime=self.runtime, cache=self.cache, note=False)
        if pool is None:
            for cand in into.feasible[before:]:
                heapq.heappush(self.heap, (cand.time_lb, next(self.seq), cand))

    def note_unexpanded(self, top: int, best_s: float) -> None:
        """Count what the bound ruled out without expanding it (``--explain``)."""
        rest = self.groups[self.next_group:]
        skipped = sum(g.size for g in rest if ((g.tp, g.pp, g.dp, g.ckpt, g.sp), g.mb) not in self.stopped)
        skipped += sum(self.fitting[g.order] for _, _, g in self.reached)
        if skipped:
            first = min([*rest[:1], *(g for _, _, g in self.reached)], key=lambda g: g.time_lb, default=None)
            example = (f"dp={first.dp} tp={first.tp} pp={first.pp} mb={first.mb}: every plan ≥ "
                       f"{first.time_lb * 1e3:.1f} ms vs {best_s * 1e3:.1f} ms (not expanded)") if first else ""
            _note(self.regions, f"bound: no faster than the best {top} plan{'s' * (top > 1)}", skipped, example)

    def everything(self) -> list[Candidate]:
        """Every candidate of every group not stopped, in group order (the infeasible report needs them)."""
        while self.next_group < len(self.groups):
            self._reach(self.groups[self.next_group])
            self.next_group += 1
        pool = Pool()
        for g in self.groups:
            if g.order in self.fitting:  # reached, not stopped
                self._expand(g, pool)
        return pool.feasible + pool.over_memory
