"""The values a user left unset, derived from what they did type: the batch sizes from the layout
(``config.validate`` calls ``resolve_batch``; ``shardwise plan`` and ``--parallel.auto`` call ``search_batch``) and
the model's vocabulary from a prepared dataset's index (``load_config`` calls ``dataset_vocab``).

The rules (docs/training.md, "Derived batch defaults"), with dp the data-parallel size (tp, cp and pp do not change
it):

* ``data.global_batch = 0``: ``16 × max(dp, 2)`` sequences (32 up to dp = 2, 16 per data-parallel rank beyond),
  raised to the next multiple of dp that the given ``micro_batch``, ``grad_accum`` and pipeline fields divide.
* ``parallel.micro_batch = 0``: ``global_batch / (grad_accum × dp)`` where ``grad_accum`` is given (pp = 1, or
  ``shardwise train``'s pipeline passes); otherwise the largest divisor of ``global_batch / dp`` up to 16 that the
  pipeline can use: with pp > 1 in ``shardwise train`` a pass of that many sequences must cut into
  ``pp_microbatches`` equal micro-batches (0: some count up to 2·pp, a multiple of pp for ``interleaved``); in
  ``shardwise predict``'s reading (one pipeline micro-batch) the rest of ``global_batch / dp`` must make the
  micro-batches per flush (a multiple of pp for ``interleaved``).

A value that is given is never changed: a batch that does not divide stays the clear error it was.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from .config_schema import Config, ParallelConfig

__all__ = ["MICRO_BATCH_CAP", "inferred_dp", "default_global_batch", "resolve_batch", "grad_accum_of", "search_batch",
           "dataset_vocab", "derived_micro_batch", "batch_fits"]

MICRO_BATCH_CAP = 16
"""The largest micro-batch the defaults choose, and the sequences per data-parallel rank of the default global
batch (at least two ranks' worth: 32 sequences)."""


def default_global_batch(dp: int) -> int:
    """``16 × max(dp, 2)``: the global batch before any rounding (a multiple of dp)."""
    return MICRO_BATCH_CAP * max(dp, 2)


def _train_reading(p: ParallelConfig, passes: bool) -> bool:
    """Whether ``micro_batch`` is sequences per forward/backward of a rank (pp = 1) or per pipeline pass of a dp
    replica (``shardwise train`` with pp > 1), rather than one pipeline micro-batch (``shardwise predict``)."""
    return p.pp == 1 or passes


def _pipeline_cuts(p: ParallelConfig, micro: int) -> bool:
    """Train's pipeline pass of ``micro`` sequences cuts into equal pipeline micro-batches (``_pp_microbatches``)."""
    if p.pp == 1:
        return True
    if p.pp_microbatches:
        return micro % p.pp_microbatches == 0
    interleaved = p.pp_schedule == "interleaved"
    return any(micro % k == 0 and (not interleaved or k % p.pp == 0) for k in range(1, min(micro, 2 * p.pp) + 1))


def batch_fits(global_batch: int, micro: int, dp: int, p: ParallelConfig, *, passes: bool = True) -> bool:
    """Whether ``global_batch`` sequences split over ``dp`` replicas in micro-batches of ``micro`` with the given
    ``grad_accum`` and pipeline fields (``passes``: train's reading of a pipeline's micro_batch). Pure."""
    per, rest = divmod(global_batch, dp)
    if rest or micro < 1 or per < micro or per % micro:
        return False
    if _train_reading(p, passes):
        return (not p.grad_accum or per == micro * p.grad_accum) and _pipeline_cuts(p, micro)
    flushes = per // micro  # the planner's reading (Layout.resolved): micro-batches per flush × flushes
    m = p.pp_microbatches or (flushes // p.grad_accum if p.grad_accum else flushes)
    accum = p.grad_accum or (flushes // m if m else 0)
    return m >= 1 and m * accum == flushes and (p.pp_schedule != "interleaved" or m % p.pp == 0)


def derived_micro_batch(global_batch: int, dp: int, p: ParallelConfig, *, passes: bool = True,
                        cap: int = MICRO_BATCH_CAP) -> int:
    """The derived ``micro_batch`` (module docstring) for this global batch, at most ``cap`` (a resumed run's
    saved micro-batch), or 0 when none fits."""
    per = global_batch // dp if global_batch % dp == 0 else 0
    if per and p.grad_accum and _train_reading(p, passes):  # global = micro × grad_accum × dp fixes it
        forced = per // p.grad_accum
        return forced if batch_fits(global_batch, forced, dp, p, passes=passes) else 0
    cap = max(cap, p.pp_microbatches if p.pp > 1 and passes else 0)
    return next((d for d in range(min(cap, per), 0, -1) if batch_fits(global_batch, d, dp, p, passes=passes)), 0)


def _works(global_batch: int, dp: int, p: ParallelConfig, passes: bool) -> bool:
    if p.micro_batch:
        return batch_fits(global_batch, p.micro_batch, dp, p, passes=passes)
    return derived_micro_batch(global_batch, dp, p, passes=passes) > 0


def _next_global(start: int, dp: int, p: ParallelConfig, passes: bool) -> int:
    """The smallest multiple of dp from ``start`` on that works, or 0. Every multiple of dp × the product below
    works when anything does, so the search is bounded."""
    unit = (p.micro_batch or 1) * (p.grad_accum or 1) * (p.pp_microbatches or 1) * p.pp
    first = -(-start // dp) * dp
    return next((g for g in range(first, first + dp * unit + 1, dp) if _works(g, dp, p, passes)), 0)


def resolve_batch(config: Config, dp: int, *, passes: bool = True, cap: int = MICRO_BATCH_CAP) -> Config:
    """``config`` with ``data.global_batch`` and ``parallel.micro_batch`` derived where they are 0 (module
    docstring; the micro-batch at most ``cap``). Given values are kept: their arithmetic is checked by
    ``validate`` as before. ``ValueError`` when a given global batch leaves no micro-batch to derive."""
    p, gb = config.parallel, config.data.global_batch
    if gb and p.micro_batch:
        return config
    if not gb:
        gb = _next_global(default_global_batch(dp), dp, p, passes) or default_global_batch(dp)
    micro = p.micro_batch or derived_micro_batch(gb, dp, p, passes=passes, cap=cap)
    if not micro:
        raise _no_micro(gb, dp, p, passes, cap)
    return dataclasses.replace(config, data=dataclasses.replace(config.data, global_batch=gb),
                               parallel=dataclasses.replace(p, micro_batch=micro))


def _no_micro(gb: int, dp: int, p: ParallelConfig, passes: bool, cap: int) -> ValueError:
    accum = p.grad_accum if p.grad_accum and _train_reading(p, passes) else 1
    better = _next_global(gb + 1, dp, p, passes)
    if gb % (dp * accum):
        what = "dp" if accum == 1 else "parallel.grad_accum × dp"
        size = f"{dp}" if accum == 1 else f"{accum} × {dp} = {accum * dp}"
        return ValueError(f"data.global_batch = {gb} must be a multiple of {what} = {size} (every data-parallel "
                          f"rank takes the same number of sequences); use --data.global_batch "
                          f"{better or -(-gb // (dp * accum)) * dp * accum}")
    fix = f"use --data.global_batch {better}, or give --parallel.micro_batch" if better else \
        "give --parallel.micro_batch"
    pipeline = (f" and that parallel.pp = {p.pp} ({p.pp_schedule}, parallel.pp_microbatches = {p.pp_microbatches}) "
                f"can cut into pipeline micro-batches" if p.pp > 1 else "")
    return ValueError(f"parallel.micro_batch (unset) has no size up to {cap} that divides data.global_batch "
                      f"/ dp = {gb} / {dp} = {gb // dp}{pipeline}; {fix}")


def grad_accum_of(config: Config, dp: int, *, launch: bool = True) -> int:
    """``parallel.grad_accum`` of a resolved batch (0 → global_batch / (micro_batch × dp)), ``ValueError`` in the
    command line's words when the batch arithmetic fails. With pp > 1 and ``launch=False`` (the planner's
    reading, ``shardwise predict``) it stays as given: the planner checks its own."""
    from ..data.windows import BatchPlan, check_grad_accum

    p, gb = config.parallel, config.data.global_batch
    if not (launch or p.pp == 1):
        return p.grad_accum
    check_grad_accum(gb, p.micro_batch, p.grad_accum, dp)  # a command-line fix, not the Python API's
    try:
        return p.grad_accum or BatchPlan.from_sizes(global_batch=gb, micro_batch=p.micro_batch, dp=dp).grad_accum
    except ValueError as exc:
        raise ValueError(f"batch arithmetic (data.global_batch = parallel.micro_batch × parallel.grad_accum × dp): "
                         f"{exc}") from None


def search_batch(config: Config, devices: int, pins: Mapping[str, Any]) -> Config:
    """``config`` with ``data.global_batch`` derived where it is 0, for a layout still to be searched on
    ``devices`` devices (``shardwise plan``, ``--parallel.auto``) with the planner's ``pins``: the rule of
    ``default_global_batch`` at the largest dp the devices and pins allow (a pinned dp, else devices / (tp × pp
    × cp) pinned), rounded up to a multiple of dp × the pinned micro_batch, microbatches and grad_accum."""
    if config.data.global_batch:
        return config
    rest = int(pins.get("tp", 1)) * int(pins.get("pp", 1)) * int(pins.get("cp", 1))
    dp = int(pins.get("dp") or max(1, devices // max(rest, 1)))
    unit = dp * int(pins.get("micro_batch", 1)) * int(pins.get("microbatches", 1)) * int(pins.get("grad_accum", 1))
    gb = -(-default_global_batch(dp) // unit) * unit
    return dataclasses.replace(config, data=dataclasses.replace(config.data, global_batch=gb))


def dataset_vocab(flat: Mapping[str, Any], base: Config) -> dict[str, Any]:
    """The dotted overrides ``flat`` (everything the user gave over ``base``) with ``model.vocab_size`` set to the
    vocabulary a prepared dataset's index states, where ``data.path`` is one, no ``model.vocab_size`` is given
    and neither ``model.hf_config`` nor ``model.pretrained`` fixes the vocabulary. An unreadable index adds
    nothing (the launcher's data check reports it)."""
    model = base.model
    if ("model.vocab_size" in flat or flat.get("model.hf_config", model.hf_config)
            or flat.get("model.pretrained", model.pretrained)):
        return dict(flat)
    from ..data.sources import prepared_vocab

    vocab = prepared_vocab(str(flat.get("data.path", base.data.path)), str(flat.get("data.format", base.data.format)))
    return {**flat, "model.vocab_size": vocab} if vocab else dict(flat)


def inferred_dp(p: ParallelConfig, nproc: int) -> int:
    """``parallel.dp``, or where it is 0, ``nproc / (cp × tp × pp)``: ``ValueError`` naming the process counts
    that fit when those axes do not divide ``nproc`` (a product that differs otherwise is ``validate``'s error)."""
    per_replica = p.tp * p.pp * p.cp
    if p.dp or nproc % per_replica == 0:
        return p.dp or nproc // per_replica
    rest = {k: v for k, v in (("cp", p.cp), ("tp", p.tp), ("pp", p.pp)) if v > 1}
    product = " × ".join(map(str, rest.values())) + (f" = {per_replica}" if len(rest) > 1 else "")
    fits = [n for n in (nproc // per_replica * per_replica, -(-nproc // per_replica) * per_replica) if n]
    raise ValueError(f"{' × '.join('parallel.' + k for k in rest)} = {product} processes per replica do not divide "
                     f"parallel.nproc = {nproc} (parallel.dp is inferred as nproc / that); set --parallel.nproc "
                     f"{' or '.join(map(str, fits))} or lower {'/'.join(rest)}")
