"""The search's pruning changes its speed, never its answer: the top plans of small searches equal a brute-force
ranking of every plan in the same space by ``predict`` (no bounds, no groups, no early stops), and the closed
forms the pruning relies on equal what the pipeline simulation counts."""

from __future__ import annotations

import dataclasses
import random

import pytest

from shardwise.parallel.pipeline.schedules import get_schedule
from shardwise.planner import Hardware
from shardwise.planner.pipeline_cost import first_rank_in_flight, simulate_flush

A100 = Hardware.preset("a100-80g-sxm")


def _peaks_by_walking(name: str, p: int, m: int, chunks: int) -> tuple[int, ...]:
    """Each rank's peak activation sets, counted by walking the generated schedule: a forward takes one, the
    action that frees it (W when backward is split, else B) gives it back. Independent of the planner."""
    sched = get_schedule(name, p=p, m=m, chunks=chunks)
    freeing = "W" if sched.split_backward else "B"
    out = []
    for acts in sched.ranks:
        held = peak = 0
        for a in acts:
            if not a.is_compute:
                continue
            held += a.kind == "F"
            held -= a.kind == freeing
            peak = max(peak, held)
        out.append(peak)
    return tuple(out)


def test_first_rank_in_flight_is_what_the_flush_simulation_holds_on_rank_0():
    """The memory bound counts rank 0's peak in closed form; it must equal the simulated flush's count (which
    for long flushes is taken on a capped one), and rank 0 must be the rank that holds the most."""
    rng = random.Random(7)
    checked = 0
    for name in ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"):
        for p in range(2, 10):
            for chunks in ((2, 3, 4) if name == "interleaved" else (1,)):
                for m in range(1, 5 * p + 2):
                    if name == "interleaved" and m % p:
                        continue
                    n = p * chunks
                    F, B, W = ([rng.uniform(0.2, 2) for _ in range(n)] for _ in range(3))
                    flush = simulate_flush(name, p, m, chunks, F, B, W, [rng.uniform(0, 0.3)] * (n - 1))
                    got = first_rank_in_flight(name, p, m, chunks)
                    assert got == flush.in_flight[0] == max(flush.in_flight), (name, p, m, chunks)
                    if m <= 4 * p and name != "gpipe":  # uncapped: also what the schedule itself holds
                        assert got == _peaks_by_walking(name, p, m, chunks)[0], (name, p, m, chunks)
                    checked += 1
    assert checked > 500
    assert first_rank_in_flight("1f1b", 1, 8, 1) == 1
    # Megatron's interleaved warm-up on rank 0: 2(p-1) + (chunks-1)p forwards, then one more
    assert first_rank_in_flight("interleaved", 4, 16, 2) == 2 * 3 + 4 + 1
