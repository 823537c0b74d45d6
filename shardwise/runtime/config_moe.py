"""The checks of expert parallelism (``parallel.ep``) against the model and the layout; one-line errors that
name the fields, the values and the fix, raised by ``config.validate`` before anything starts. Pure."""

from __future__ import annotations

from typing import Any

__all__ = ["check_experts"]


def check_experts(config: Any, dp: int) -> None:
    """``parallel.ep`` folds into the ``dp × cp`` ranks and splits ``model.n_experts``; a dense model takes
    ep = 1 only. ``dp``: the resolved data-parallel size."""
    m, p = config.model, config.parallel
    ep, experts = p.ep, getattr(m, "n_experts", 0)
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"parallel.ep = {ep!r} must be a positive int (1 = no expert parallelism)")
    if ep > 1 and not experts:
        raise ValueError(f"parallel.ep = {ep} splits the experts of a mixture of experts, but the model has none "
                         f"(model.n_experts = 0); set --model.n_experts (e.g. {ep * 2}) or --parallel.ep 1")
    if ep > 1 and experts % ep:
        raise ValueError(f"parallel.ep = {ep} must divide model.n_experts = {experts} (each rank holds "
                         f"n_experts / ep experts); pick ep among {_divisors(experts)}")
    token_ranks = dp * p.cp
    if token_ranks % ep:
        raise ValueError(f"parallel.ep = {ep} must divide the data-parallel ranks it folds into, parallel.dp × "
                         f"parallel.cp = {dp} × {p.cp} = {token_ranks}; pick ep among "
                         f"{[d for d in _divisors(token_ranks) if not experts or experts % d == 0]}")
    if experts and p.sequence_parallel and p.tp > 1:
        raise ValueError("parallel.sequence_parallel with model.n_experts > 0 is not supported: the MoE layers "
                         "need every tensor-parallel rank's whole sequence; use --parallel.sequence_parallel false")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
