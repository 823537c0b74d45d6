"""Pipeline actions: the instructions a schedule lists for each rank, with a short text form.

An action is ``(stage, kind, microbatch)``. Its text form is ``f"{stage}{kind}{microbatch}"``:

=========  ==========  ===========================================================================
text       kind        meaning (for stage ``s`` and micro-batch ``i``)
=========  ==========  ===========================================================================
``1F0``    ``F``       forward of stage 1 on micro-batch 0
``0B3``    ``B``       backward of stage 0, micro-batch 3: the input gradient only when the schedule
                       splits backward (``Schedule.split_backward``), else the full backward
``2W5``    ``W``       weight gradient of stage 2, micro-batch 5 (split schedules only)
``1RF0``   ``RECV_F``  stage 1 receives its input activation for micro-batch 0 from stage 0
``1SF0``   ``SEND_F``  stage 1 sends its output activation for micro-batch 0 to stage 2
``1RB0``   ``RECV_B``  stage 1 receives the gradient of its output for micro-batch 0 from stage 2
``1SB0``   ``SEND_B``  stage 1 sends the gradient of its input for micro-batch 0 to stage 0
=========  ==========  ===========================================================================

The communication actions are never produced by the schedule generators; ``lower_communication`` in
``communication.py`` inserts them for an executor. The simulator models communication as a latency on every
dependency that crosses ranks and skips explicit communication actions.

Stage placement: with ``p`` ranks and ``chunks`` model chunks per rank there are ``p * chunks`` stages and
stage ``s`` lives on rank ``s % p`` as its chunk ``s // p`` (so stage = chunk * p + rank, the standard
interleaved assignment: rank 0 holds stages 0, p, 2p, ...). With ``chunks == 1`` stage == rank.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, get_args

__all__ = ["Action", "ActionKind", "COMPUTE_KINDS", "COMM_KINDS", "Schedule", "parse_action", "parse_actions",
           "parse_schedule"]

ActionKind = Literal["F", "B", "W", "SEND_F", "RECV_F", "SEND_B", "RECV_B"]
COMPUTE_KINDS: tuple[str, ...] = ("F", "B", "W")
COMM_KINDS: tuple[str, ...] = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")

# kind <-> the letters between the stage and micro-batch numbers in the text form
_KIND_TO_TEXT = {"F": "F", "B": "B", "W": "W", "SEND_F": "SF", "RECV_F": "RF", "SEND_B": "SB", "RECV_B": "RB"}
_TEXT_TO_KIND = {v: k for k, v in _KIND_TO_TEXT.items()}
_ACTION_RE = re.compile(r"^(\d+)(F|B|W|SF|RF|SB|RB)(\d+)$")
_KINDS = frozenset(_KIND_TO_TEXT)  # get_args(ActionKind) once, not per action (schedules build thousands)


@dataclass(frozen=True, order=True)
class Action:
    """One instruction of a rank: run ``kind`` for ``stage`` on ``microbatch``. ``str`` gives ``"1F0"``."""

    stage: int
    """Global stage index (``chunk * p + rank``)."""
    kind: ActionKind
    """``F`` forward, ``B`` (input-)gradient, ``W`` weight gradient, or a send/receive (see module doc)."""
    microbatch: int
    """Micro-batch index, 0-based."""

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"action kind must be one of {get_args(ActionKind)}, got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"stage and micro-batch must be >= 0, got stage={self.stage}, "
                             f"microbatch={self.microbatch}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        return f"{self.stage}{_KIND_TO_TEXT[self.kind]}{self.microbatch}"


def parse_action(text: str) -> Action:
    """Read the text form (``"1F0"``, ``"0B3"``, ``"2W5"``, ``"1SF0"``...) back into an ``Action``."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"cannot parse pipeline action {text!r}: expected <stage><kind><microbatch> with kind "
                         f"one of {', '.join(_TEXT_TO_KIND)} (e.g. '1F0', '0B3', '2W5', '1SF0')")
    stage, kind, mb = match.groups()
    return Action(int(stage), _TEXT_TO_KIND[kind], int(mb))  # type: ignore[arg-type]


def parse_actions(text: str) -> list[Action]:
    """Read a whitespace- or comma-separated list of actions (``"0F0 0F1 0B0"``); ``-`` entries are skipped."""
    tokens = [t for t in re.split(r"[\s,]+", text.strip()) if t and t != "-"]
    return [parse_action(t) for t in tokens]


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule as plain data: for every rank, the ordered actions it executes in one step.

    ``ranks[r]`` is rank ``r``'s action list; stage ``s`` runs on rank ``s % p`` (see module doc). No
    communication happens here: a schedule can be printed, parsed, validated and simulated anywhere.
    """

    name: str
    """Generator name (``gpipe``, ``1f1b``, ``interleaved``, ``zb-h1``) or ``custom`` for parsed text."""
    p: int
    """Number of pipeline ranks."""
    m: int
    """Number of micro-batches per step."""
    chunks: int
    """Model chunks (virtual stages) per rank; ``p * chunks`` stages in all."""
    split_backward: bool
    """True when backward is split into ``B`` (input gradient) and ``W`` (weight gradient)."""
    ranks: tuple[tuple[Action, ...], ...]
    """Per-rank ordered action lists."""
    forward_only: bool = False
    """True for an evaluation schedule (``schedules.forward_only``): ``F`` actions only, nothing to differentiate.
    A training schedule (the default) must list every ``B`` (and ``W``) as well."""

    @property
    def num_stages(self) -> int:
        return self.p * self.chunks

    def rank_of(self, stage: int) -> int:
        """The rank that holds ``stage`` (``stage % p``)."""
        return stage % self.p

    def compute_kinds(self) -> tuple[str, ...]:
        if self.forward_only:
            return ("F",)
        return ("F", "B", "W") if self.split_backward else ("F", "B")

    def validate(self) -> None:
        """Check every (stage, kind, micro-batch) compute action appears exactly once, on its stage's rank
        (kinds: ``compute_kinds()``, so a forward-only schedule lists ``F`` only and a training one all of them).

        Raises ``ValueError`` naming the missing, duplicated or misplaced actions. Ordering (deadlocks) is the
        simulator's job: see ``simulate``.
        """
        if len(self.ranks) != self.p:
            raise ValueError(f"schedule {self.name!r} has {len(self.ranks)} rank lists but p={self.p}")
        if self.forward_only and self.split_backward:
            raise ValueError(f"schedule {self.name!r} is forward_only, so it has no backward to split, but "
                             f"split_backward=True; use split_backward=False")
        seen: dict[Action, int] = {}
        misplaced: list[str] = []
        for rank, actions in enumerate(self.ranks):
            for a in actions:
                if self.rank_of(a.stage) != rank or a.stage >= self.num_stages or a.microbatch >= self.m:
                    misplaced.append(f"{a} on rank {rank}")
                if a.is_compute:
                    seen[a] = seen.get(a, 0) + 1
        expected = {Action(s, k, i)  # type: ignore[arg-type]
                    for s in range(self.num_stages) for k in self.compute_kinds() for i in range(self.m)}
        missing = sorted(expected - set(seen))
        extra = sorted(a for a, n in seen.items() if n > 1 or a not in expected)
        if misplaced or missing or extra:
            raise ValueError(
                f"schedule {self.name!r} (p={self.p}, m={self.m}, chunks={self.chunks}) is not a valid step: "
                f"each compute action must appear exactly once on rank stage % p. "
                f"missing: {_short(missing)}; duplicated/unexpected: {_short(extra)}; "
                f"out of range or on the wrong rank: {_short(misplaced)}")

    def to_text(self) -> str:
        """One line per rank: ``rank 0: 0F0 0F1 0B0 ...`` (read back by ``parse_schedule``)."""
        return "\n".join(f"rank {r}: " + " ".join(str(a) for a in acts) for r, acts in enumerate(self.ranks))

    def grid(self, marks: dict[tuple[int, int], str] | None = None) -> str:
        """The step x rank grid (one row per step, one column per rank); ``marks[(rank, step)]`` flags cells."""
        marks = marks or {}
        steps = max((len(a) for a in self.ranks), default=0)
        cells = [[str(a) + marks.get((r, i), "") for i, a in enumerate(acts)] for r, acts in enumerate(self.ranks)]
        width = max([len(c) for col in cells for c in col] + [6])
        lines = ["step  " + " ".join(f"{'rank ' + str(r):<{width}}" for r in range(self.p))]
        for i in range(steps):
            row = [(col[i] if i < len(col) else "-") for col in cells]
            lines.append(f"{i:<5} " + " ".join(f"{c:<{width}}" for c in row))
        return "\n".join(lines)


def _short(items: list, limit: int = 6) -> str:
    if not items:
        return "none"
    shown = ", ".join(str(x) for x in items[:limit])
    return shown + (f" ... ({len(items)} in all)" if len(items) > limit else "")


def parse_schedule(text: str, *, name: str = "custom", m: int | None = None, chunks: int = 1) -> Schedule:
    """Read per-rank action lists, one rank per line (``"rank 0: 0F0 0B0"`` or just ``"0F0 0B0"``).

    ``p`` is the number of lines; ``m`` defaults to the largest micro-batch index + 1; backward counts as
    split when any ``W`` action appears. The result is validated (``Schedule.validate``).
    """
    lines = [ln.split(":", 1)[-1] for ln in text.strip().splitlines() if ln.strip()]
    ranks = tuple(tuple(parse_actions(ln)) for ln in lines)
    if not ranks:
        raise ValueError("cannot parse an empty schedule: give one line of actions per rank")
    all_actions = [a for acts in ranks for a in acts]
    m = m if m is not None else max((a.microbatch for a in all_actions), default=-1) + 1
    split = any(a.kind == "W" for a in all_actions)
    sched = Schedule(name=name, p=len(ranks), m=m, chunks=chunks, split_backward=split, ranks=ranks)
    sched.validate()
    return sched
