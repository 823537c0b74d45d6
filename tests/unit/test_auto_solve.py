"""``sw.auto``'s solver against brute force: exact frontier DP (with and without a memory budget) on random small
graphs, and the measured gap of its beam fallback."""

from __future__ import annotations

import random

import pytest

from shardwise.parallel.auto.options import Option
from shardwise.parallel.auto.solve import NoFit, brute_force, solve

SBPS = ("B", "Sf")


def _random_problem(rng: random.Random, n: int) -> tuple[list[list[Option]], list[tuple[int, ...]]]:
    """A random DAG in topological order (each node reads 0-2 earlier nodes: chains, branches and joins) with
    2-4 random options per node."""
    options, preds = [], []
    for v in range(n):
        k = rng.choice([0, 1, 1, 2]) if v else 0
        preds.append(tuple(sorted(rng.sample(range(v), min(k, v)))))
        opts = []
        for j in range(rng.randint(2, 4)):
            need = rng.choice(SBPS + ("any",) if not preds[-1] else SBPS)
            opts.append(Option(f"k{j}", None, need, rng.choice(SBPS), rng.uniform(0, 10), rng.uniform(0, 10)))
        # one always-feasible replicated option keeps most problems solvable
        opts.append(Option("B", None, "B", "B", rng.uniform(5, 15), rng.uniform(5, 15)))
        options.append(opts)
    return options, preds


@pytest.mark.parametrize("seed", range(40))
def test_dp_equals_brute_force(seed):
    rng = random.Random(seed)
    options, preds = _random_problem(rng, rng.randint(2, 7))
    exact = brute_force(options, preds)
    sol = solve(options, preds)
    assert sol.exact
    assert sol.time_s == pytest.approx(exact.time_s)
    chosen = [options[v][j] for v, j in enumerate(sol.choice)]
    assert sum(o.time_s for o in chosen) == pytest.approx(sol.time_s)  # the choice really costs what it says
    assert brute_force([[options[v][j]] for v, j in enumerate(sol.choice)], preds) is not None  # and is feasible


@pytest.mark.parametrize("seed", range(20))
def test_dp_with_budget_equals_brute_force(seed):
    rng = random.Random(100 + seed)
    options, preds = _random_problem(rng, rng.randint(3, 6))
    budget = sum(min(o.memory for o in opts) for opts in options) * 1.3
    exact = brute_force(options, preds, budget)
    if exact is None:
        with pytest.raises(NoFit) as info:
            solve(options, preds, budget)
        assert info.value.min_memory > budget
        return
    sol = solve(options, preds, budget)
    assert sol.time_s == pytest.approx(exact.time_s) and sol.memory <= budget


def test_no_fit_names_the_smallest_footprint():
    opts = [[Option("B", None, "B", "B", 1.0, 5.0), Option("c", None, "B", "B", 2.0, 3.0)]] * 2
    with pytest.raises(NoFit) as info:
        solve(opts, [(), (0,)], budget=5.0)
    assert info.value.min_memory == 6.0


def test_beam_gap_is_measured():
    """With too few states allowed the search keeps only the cheapest partial states (a beam). Over 60 random
    graphs: never better than exact (sanity), flagged as not exact, and the mean relative gap stays small."""
    gaps, flagged = [], 0
    for seed in range(60):
        rng = random.Random(1000 + seed)
        options, preds = _random_problem(rng, 7)
        exact = brute_force(options, preds)
        try:
            beam = solve(options, preds, max_states=4)
        except ValueError:  # the beam dropped every state that could finish
            gaps.append(1.0)
            continue
        assert beam.time_s >= exact.time_s - 1e-9
        flagged += not beam.exact
        gaps.append(beam.time_s / exact.time_s - 1)
    mean = sum(gaps) / len(gaps)
    print(f"beam(4) mean gap {mean:.3%}, max {max(gaps):.3%}, pruned in {flagged}/60")
    assert flagged > 0 and mean < 0.10
