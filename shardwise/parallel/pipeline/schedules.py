"""Schedule generators: GPipe, 1F1B, interleaved 1F1B, zero-bubble H1 and H2, as plain per-rank action lists.

All generators are pure functions of ``(p, m, chunks)``; ``get_schedule`` checks the input first. The
bubble and memory of each (equal per-stage costs, no communication time, ``F``/``B``/``W`` the costs of one
stage's forward, input-gradient and weight-gradient work for one micro-batch):

============  ====================================  ==============================  =========================
schedule      idle time per rank                    activations held on rank r      constraint
============  ====================================  ==============================  =========================
gpipe         (p-1)(F+B+W)                          m                               m >= 1
1f1b          (p-1)(F+B+W)                          min(p-r, m)                     m >= 1
interleaved   (p-1)(F+B+W)/chunks (chunk costs       about p + (p-r-1) chunks        chunks >= 2, m % p == 0
              are the rank's costs / chunks)
zb-h1         (p-1)(F+B-W)                          min(p, m) (max over ranks, as  m >= 1
                                                    1F1B's rank 0)
zb-h2         (p-1)F, the least any one step can    min(2p-1, m) on every rank      m >= 1 (m < 2p-1: fewer
              have, for m >= 2p-1 when B <= 2F and                                  warm-up forwards, see
              B <= 2W; no gap inside a rank's span                                  ``zb_h2``)
              at F = B = W
============  ====================================  ==============================  =========================

GPipe (Huang et al. 2019) runs every forward then every backward. 1F1B (PipeDream-flush, Narayanan et al.
2021) starts backward as soon as the last stage can, so rank r holds at most p - r micro-batches.
Interleaved 1F1B (Narayanan et al. 2021, the Megatron-LM variant) gives each rank ``chunks`` thinner
stages, shrinking the warm-up/cool-down by ``chunks``; its micro-batch order (groups of p micro-batches per
chunk) needs ``m % p == 0``. ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism") splits backward into
B (needed upstream, on the critical path) and W (needed by nobody) and lets rank r postpone r of its W's,
which fills the cool-down bubble while no rank holds more than p micro-batches. ZB-H2 (same paper) spends
memory instead: up to 2p-1 warm-up forwards fill the wait for the first B, and W's postponed in the tail
make every rank's busy span a parallelogram (rank r busy from r*F on, without a gap at F = B = W). Its idle
time within one step is then only the unavoidable ramp (rank r's first input arrives at r*F); consecutive
steps with no barrier between them (the paper's optimizer post-validation) interlock the ramps, so the
bubble per step tends to zero — a flushed step still idles (p-1)F, which at F = B = W is ZB-H1's figure.
"""

from __future__ import annotations

from typing import Callable

from .actions import Action, Schedule

__all__ = ["SCHEDULES", "gpipe", "one_f_one_b", "interleaved", "zb_h1", "zb_h2", "get_schedule", "forward_only"]


def _f(stage: int, mb: int) -> Action:
    return Action(stage, "F", mb)


def _b(stage: int, mb: int) -> Action:
    return Action(stage, "B", mb)


def _w(stage: int, mb: int) -> Action:
    return Action(stage, "W", mb)


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (full backward, in micro-batch order). Holds m micro-batches."""
    ranks = tuple(tuple([_f(r, i) for i in range(m)] + [_b(r, i) for i in range(m)]) for r in range(p))
    return Schedule(name="gpipe", p=p, m=m, chunks=1, split_backward=False, ranks=ranks)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B: p-r-1 warm-up forwards on rank r, then alternate forward/backward, then drain the backwards."""
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [_f(r, i) for i in range(warmup)]
        for j in range(m - warmup):
            acts += [_f(r, warmup + j), _b(r, j)]
        acts += [_b(r, j) for j in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return Schedule(name="1f1b", p=p, m=m, chunks=1, split_backward=False, ranks=tuple(ranks))


def interleaved(p: int, m: int, chunks: int) -> Schedule:
    """Interleaved 1F1B (Megatron order): rank r runs stages r, p + r, ..., (chunks-1)p + r.

    The k-th forward of a rank is chunk ``(k // p) % chunks`` on micro-batch ``(k // (p*chunks)) * p + k % p``
    (groups of p micro-batches go through one chunk, then the next); backwards use the same order with the
    chunks reversed. Warm-up is ``2(p-r-1) + (chunks-1)p`` forwards (all of them when m == p).
    """
    total = m * chunks
    order = lambda k, backward: _megatron_order(p, chunks, k, backward)  # noqa: E731

    ranks = []
    for r in range(p):
        warmup = total if m == p else min(2 * (p - r - 1) + (chunks - 1) * p, total)
        fwd = [_f(c * p + r, mb) for c, mb in (order(k, False) for k in range(total))]
        bwd = [_b(c * p + r, mb) for c, mb in (order(k, True) for k in range(total))]
        acts = fwd[:warmup]
        for j in range(total - warmup):
            acts += [fwd[warmup + j], bwd[j]]
        acts += bwd[total - warmup:]
        ranks.append(tuple(acts))
    return Schedule(name="interleaved", p=p, m=m, chunks=chunks, split_backward=False, ranks=tuple(ranks))


def _megatron_order(p: int, chunks: int, k: int, backward: bool) -> tuple[int, int]:
    """(chunk, micro-batch) of a rank's k-th forward (or backward) in the interleaved order: groups of p
    micro-batches go through one chunk, then the next (backward: chunks reversed)."""
    chunk = (k // p) % chunks
    mb = (k // (p * chunks)) * p + k % p
    return (chunks - 1 - chunk if backward else chunk), mb


def forward_only(p: int, m: int, chunks: int = 1) -> Schedule:
    """Evaluation: every stage runs ``F`` for each micro-batch, in micro-batch order; no ``B``/``W``.

    ``chunks == 1``: rank r runs ``F(r, 0), ..., F(r, m-1)``, and stage s starts as soon as micro-batch 0
    reaches it, so the step takes (m + p - 1) forwards, with nothing held for a backward. ``chunks > 1``: the
    virtual stages in interleaved order (groups of p micro-batches per chunk, as ``interleaved``'s forwards,
    ``m % p == 0``), so rank r's next chunk starts on a group while the ranks after it are still busy with
    the previous one, and a rank holds receives for at most about one group per chunk.
    """
    for label, value in (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
    if chunks > 1 and m % p != 0:
        raise ValueError(f"a forward-only schedule with chunks={chunks} runs micro-batches in groups of p, so m "
                         f"must be a multiple of p, got m={m}, p={p}; use m={(m // p + 1) * p}")
    ranks = tuple(tuple(_f(c * p + r, mb) for c, mb in (_megatron_order(p, chunks, k, False)
                                                         for k in range(m * chunks))) for r in range(p))
    schedule = Schedule(name="forward-only", p=p, m=m, chunks=chunks, split_backward=False, ranks=ranks,
                        forward_only=True)
    schedule.validate()
    return schedule


def zb_h1(p: int, m: int) -> Schedule:
    """Zero-bubble H1: 1F1B's warm-up, then ``B_j`` / postponed ``W_{j-r}`` / next ``F`` on rank r.

    Rank r runs min(p - r, m) forwards, then for each micro-batch j: B_j, then W_{j-r} (if j >= r), then the
    next forward; the last r weight gradients run at the end. So rank r holds at most (p - r) + r = p
    micro-batches (the activations a W still needs), the peak of 1F1B's rank 0.
    """
    ranks = []
    for r in range(p):
        warmup = min(p - r, m)
        acts = [_f(r, i) for i in range(warmup)]
        next_f = warmup
        for j in range(m):
            acts.append(_b(r, j))
            if j >= r:
                acts.append(_w(r, j - r))
            if next_f < m:
                acts.append(_f(r, next_f))
                next_f += 1
        acts += [_w(r, j) for j in range(max(m - r, 0), m)]
        ranks.append(tuple(acts))
    return Schedule(name="zb-h1", p=p, m=m, chunks=1, split_backward=True, ranks=tuple(ranks))


def zb_h2(p: int, m: int) -> Schedule:
    """Zero-bubble H2: up to 2p-1 warm-up forwards, steady ``B_j W_j F``, a tail that postpones W's.

    Rank r (one slot = one unit of F = B = W, comm 0; rank r's slot k runs at time r + k):

    * warm-up: ``n_r = min(2(p-r)-1, m)`` forwards. Rank r's first ``B_0`` can start at 2p-1-r (``F_0``
      reaches rank p-1 at p-1, then ``B_0`` climbs one rank per slot), and rank r starts at r: exactly
      2p-1-2r slots to fill with forwards (1F1B/ZB-H1 fill only p-r of them and idle the rest).
    * steady state, for ``j <= m - 2p``: ``B_j``, ``W_j``, the next ``F`` (3 slots per micro-batch on every
      rank, so rank r+1's ``B_j`` always ends just as rank r needs it). Holding stays at ``n_r``.
    * tail, the last ``min(m, 2p-1)`` backwards: ``B_j``, then the next forward while any is left (rank r
      has 2r left when m >= 2p-1; their W's wait), else one postponed W; after the last B every W left.
      B's now come every 2 slots on every rank, so rank 0 ends at 3m and rank r at r + 3m: a parallelogram.

    Every rank holds at most ``min(2p-1, m)`` micro-batches (rank 0 after its warm-up; rank r > 0 at the end
    of its tail). ``m < 2p-1`` (fallback): there is no steady state; ranks whose warm-up would exceed m run
    all m forwards first, then alternate B and W. At F = B = W the step time is ``max(3m + p-1, 2m + 2p-1)``
    for every m (the second term: rank 0 waits 2p-1 for ``B_0``, then has 2m of B and W work).
    """
    ranks = []
    for r in range(p):
        warmup = min(2 * (p - r) - 1, m)
        acts = [_f(r, i) for i in range(warmup)]
        next_f, next_w = warmup, 0
        for j in range(m):
            acts.append(_b(r, j))
            if j <= m - 2 * p:  # steady state: warmup == 2(p-r)-1, so a forward is always left here
                acts += [_w(r, j), _f(r, next_f)]
                next_w, next_f = j + 1, next_f + 1
            elif next_f < m:  # tail: forward first, this W waits
                acts.append(_f(r, next_f))
                next_f += 1
            elif j < m - 1:  # tail, forwards done: one postponed W between consecutive B's
                acts.append(_w(r, next_w))
                next_w += 1
        acts += [_w(r, j) for j in range(next_w, m)]
        ranks.append(tuple(acts))
    return Schedule(name="zb-h2", p=p, m=m, chunks=1, split_backward=True, ranks=tuple(ranks))


# name -> (generator taking (p, m, chunks), needs chunks > 1)
SCHEDULES: dict[str, tuple[Callable[[int, int, int], Schedule], bool]] = {
    "gpipe": (lambda p, m, c: gpipe(p, m), False),
    "1f1b": (lambda p, m, c: one_f_one_b(p, m), False),
    "interleaved": (interleaved, True),
    "zb-h1": (lambda p, m, c: zb_h1(p, m), False),
    "zb-h2": (lambda p, m, c: zb_h2(p, m), False),
}


def _did_you_mean(name: str, choices: "dict[str, object] | list[str]") -> str:
    """``"; did you mean '1f1b'?"`` for a close schedule name (difflib), else ``""``."""
    import difflib

    close = difflib.get_close_matches(name.lower(), list(choices), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def get_schedule(name: str, *, p: int, m: int, chunks: int = 1) -> Schedule:
    """Build schedule ``name`` for ``p`` ranks and ``m`` micro-batches; bad input raises ``ValueError``."""
    key = name.lower()
    if key not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}"
                         f"{_did_you_mean(str(name), SCHEDULES)}")
    for label, value in (("p (pipeline ranks)", p), ("m (micro-batches)", m), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {value!r}")
    generator, multi_chunk = SCHEDULES[key]
    if multi_chunk and chunks < 2:
        raise ValueError(f"schedule {key!r} needs chunks >= 2 model chunks per rank, got chunks={chunks}; "
                         f"use schedule='1f1b' for one chunk per rank")
    if not multi_chunk and chunks != 1:
        raise ValueError(f"schedule {key!r} runs one model chunk per rank, got chunks={chunks}; use "
                         f"schedule='interleaved' for several chunks per rank, or chunks=1")
    if multi_chunk and m % p != 0:
        options = sorted({max(p, (m // p) * p), (m // p + 1) * p})
        raise ValueError(f"schedule {key!r} needs the micro-batch count to be a multiple of p (Megatron order: "
                         f"groups of p micro-batches per chunk), got m={m}, p={p}; use m="
                         + " or m=".join(str(o) for o in options))
    schedule = generator(p, m, chunks)
    schedule.validate()
    return schedule
