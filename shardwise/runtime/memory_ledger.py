"""The measured side of the memory ledger: a peak per phase of the run, next to the layout's floor.

``PhaseMeter`` resets the high-water mark when a phase begins and reads it when the phase ends: on CPU ranks
the resident set's ``VmHWM`` (``/proc/self/status``), reset by writing ``5`` to ``/proc/self/clear_refs``; on
CUDA the caching allocator's ``max_memory_allocated``, reset by ``reset_peak_memory_stats``; where neither
resets (no ``/proc``), one whole-run peak and no phases. Each reset first folds the mark it clears into the
whole-run peak, so the run's peak stays what ``peak_memory_bytes`` reported before phases existed. Cost: two
``pread`` s of the status, a write and ``mallinfo2`` per phase on a CPU (20-50 µs measured, three phases a step),
two allocator calls on CUDA; no tensor hooks.

Allocator slack (CPU): the bytes glibc holds free inside its arenas (``mallinfo2().fordblks``, read by
``allocator.retained_bytes``) at the end of each phase — memory the process freed that stays in its resident set (until glibc trims it); None on
allocators without ``mallinfo2`` (musl, macOS).

``ledger`` turns a meter, the floor (``planner/ledger.py``) and the bare runtime into the rank's
``memory_ledger`` JSON: per phase the peak above the bare runtime, its floor and what exceeds it, named.
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch

from ..allocator import _glibc, retained_bytes

__all__ = ["PhaseMeter", "allocator_slack", "ledger", "rank_ledger", "rank_floor_of", "fullest", "strategy_memory",
           "activation_peak"]

_CLEAR_REFS = "/proc/self/clear_refs"
_GLIBC = _glibc() is not None and hasattr(_glibc(), "mallinfo2")  # retained_bytes() is 0 elsewhere: unknown

EXCESS_NAMES = {"construction": "construction temporaries", "forward": "forward temporaries",
                "backward": "gradient buffers", "forward+backward": "pipeline buffers and gradients",
                "step": "optimizer temporaries", "save": "the save's gather", "eval": "evaluation temporaries"}
"""What a phase's own rise above its floor is, once allocator slack and activations above the model are named:
construction, a full tensor being sliced and initialisation buffers; forward, gathered units, casts and messages
beyond the floor's; backward, full gradients before their reduction and autograd's temporaries; step, the
optimizer's intermediate tensors; save, the pieces gathered or copied for writing."""

HELD = "held on entry"
"""The part of a phase's excess it did not allocate itself: what the process held when the phase began beyond
the floor — runtime pages and caches grown since the bare runtime (the first forward loads autograd's and the
kernels' code), memory an earlier phase left behind."""


def allocator_slack() -> int | None:
    """Bytes glibc's malloc holds free in its arenas now (``allocator.retained_bytes``); None on other C
    libraries (musl, macOS), where it is not known."""
    return retained_bytes() if _GLIBC else None


def _vm_hwm() -> int:
    """``VmHWM`` of ``/proc/self/status`` in bytes (``metrics.resident_peak_bytes`` without its fallback: this
    module only reads it where ``/proc`` exists)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _proc() -> bool:
    try:
        return _vm_hwm() > 0
    except OSError:
        return False


def _can_clear() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhaseMeter:
    """Per-phase peaks of this process (see module docstring). ``begin(phase)`` ends the open phase and starts
    ``phase``; ``end()`` closes it. A phase met again (every step's forward) keeps its highest peak. Local."""

    def __init__(self, device: torch.device, *, begin: str | None = None) -> None:
        self.device = device
        self._status_fd = self._clear_fd = -1
        self._fallback = device.type != "cuda" and not _proc()
        self.mode = "cuda" if device.type == "cuda" else "whole"
        self.whole = self._read()  # before the probe below clears the mark
        if self.mode == "whole" and _can_clear():
            self.mode = "rss"
        self.peaks: dict[str, int] = {}
        self.slack: dict[str, int] = {}
        self.rise: dict[str, int] = {}
        """Per phase how far its last occurrence grew above what the process held when it began (peak - start):
        a steady step's, not the first's (which also allocates the optimizer state and warms the runtime up)."""
        self._start = 0
        self.current: str | None = None
        if begin is not None:
            self.begin(begin)

    def _read(self) -> int:
        if self.mode == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        if self._fallback:  # no /proc: getrusage's peak, which nothing resets (KiB on Linux, bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            return int(rss if sys.platform == "darwin" else rss * 1024)
        if self._status_fd < 0:  # kept open: a pread of the status costs half of opening it each time
            self._status_fd = os.open("/proc/self/status", os.O_RDONLY)
        text = os.pread(self._status_fd, 8192, 0)
        at = text.find(b"VmHWM:")
        return int(text[at + 6:text.index(b"kB", at)]) * 1024

    def _reset(self, folded: bool) -> None:
        if not folded:  # the mark about to be cleared still counts for the run (end() folded it if a phase was open)
            self.whole = max(self.whole, self._read())
        if self.mode == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.mode == "rss":
            if self._clear_fd < 0:
                self._clear_fd = os.open(_CLEAR_REFS, os.O_WRONLY)
            os.pwrite(self._clear_fd, b"5", 0)

    def begin(self, phase: str) -> None:
        """Close the open phase, reset the high-water mark and open ``phase``. Local; a few syscalls."""
        folded = self.current is not None
        self.end()
        self._reset(folded)
        self._start = self._read() if self.mode != "whole" else 0  # right after a reset: what is held now
        self.current = phase

    def end(self) -> None:
        """Close the open phase (if any): its peak, and on a CPU the allocator's slack now."""
        if self.current is None:
            return
        peak = self._read()
        self.whole = max(self.whole, peak)
        if self.mode != "whole":  # without a reset every "phase" would be the run's peak so far
            self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            self.rise[self.current] = peak - self._start
            slack = allocator_slack() if self.mode == "rss" else None
            if slack is not None:
                self.slack[self.current] = max(self.slack.get(self.current, 0), slack)
        self.current = None

    def __del__(self) -> None:
        for fd in (getattr(self, "_status_fd", -1), getattr(self, "_clear_fd", -1)):
            if fd >= 0:
                os.close(fd)

    def close(self) -> int:
        """``end()``, then the whole-run peak so far."""
        self.end()
        return self.whole_peak()

    def whole_peak(self) -> int:
        """The process's peak over the whole run so far (every phase, and between them)."""
        return max(self.whole, self._read())


def rank_floor_of(cfg: Any, pp_rank: int) -> tuple[dict[str, Any], dict[str, float], dict[str, float]] | None:
    """``(floor JSON, floor per phase, what of it each phase allocates)`` of this rank's layout (``planner/ledger.py``), or None where the planner
    cannot price the model or layout (the ledger then shows the measured side only). Pure."""
    from ..planner.ledger import layout_floor, phase_allocations, phase_floors
    from .prediction import gpt_spec, plan_from_config

    try:
        plan = plan_from_config(cfg, train_passes=True)
        floors = layout_floor(gpt_spec(cfg), plan, global_batch=cfg.data.global_batch,
                              bucket_bytes=cfg.parallel.bucket_cap_mb * 2**20)
    except Exception:  # noqa: BLE001 - a model or layout the planner cannot price must not fail the run
        return None
    floor = floors[min(pp_rank, len(floors) - 1)]
    resolved = plan.resolved(cfg.data.global_batch)
    return floor.to_json(), phase_floors(floor, resolved), phase_allocations(floor, resolved)


def _named(phase: str, excess: int, slack: int | None, activations_over: int, own: int) -> list[tuple[str, int]]:
    """A phase's excess over its floor, named: allocator slack first, then activations above the model (passes
    only), then the phase's own temporaries (``EXCESS_NAMES``: at most ``own``, what the phase rose by beyond
    what of the floor it allocates itself), and what is left was held before the phase began (runtime pages and
    caches grown since the bare runtime, memory an earlier phase left behind)."""
    out, left = [], excess
    own = max(0, own - (activations_over if "ward" in phase else 0))
    for name, amount in (("allocator slack", slack or 0),
                         ("activations above the model", activations_over if "ward" in phase else 0),
                         (EXCESS_NAMES.get(phase, phase), own)):
        take = min(left, max(0, amount))
        if take:
            out.append((name, take))
            left -= take
    if left > 0:
        out.append((HELD, left))
    return out


def ledger(meter: PhaseMeter, bare: int, floor: tuple[dict[str, Any], dict[str, float], dict[str, float]] | None,
           activation_peak: int = 0) -> dict[str, Any]:
    """This rank's ``memory_ledger`` (bytes; peaks above the bare runtime ``bare``): ``floor`` (terms and total,
    or None), ``phases`` (per phase ``peak``, ``rise`` above its start, ``floor``, ``excess`` as ``[name, bytes]``
    pairs, ``slack``), ``whole_peak``, ``ratio`` (whole-run peak / floor), ``peak_phase``, ``held_on_entry`` (of
    the peak's phase: ``HELD``) and ``biggest_excess`` ``[phase, name, bytes]``: the peak phase's largest named
    excess (``HELD`` only when nothing else exceeds). ``activation_peak``: the saved-for-backward high-water mark measured (CPU), 0 if unknown."""
    meter.end()  # the last phase (the final save) closes here
    terms, per_phase, allocs = floor if floor is not None else (None, {}, {})
    act_over = max(0, activation_peak - int(terms["activations"])) if terms and activation_peak else 0
    phases: dict[str, Any] = {}
    for name, peak in meter.peaks.items():
        above, want = max(0, peak - bare), per_phase.get(name)
        slack = meter.slack.get(name)
        rise = meter.rise.get(name, 0)
        own = rise - int(allocs.get(name, 0))
        excess = _named(name, max(0, above - int(want)), slack, act_over, own) if want is not None else []
        phases[name] = {"peak": above, "rise": rise, "floor": int(want) if want is not None else None, "slack": slack,
                        "excess": [[n, b] for n, b in excess]}
    whole = max(0, meter.whole_peak() - bare)
    peak_phase = max(phases, key=lambda k: phases[k]["peak"]) if phases else None
    total = terms["total"] if terms else None
    # what makes the peak: the peak phase's own excess (what it held on entry is an earlier phase's, named apart)
    named = [(peak_phase, n, b) for n, b in phases[peak_phase]["excess"]] if peak_phase else []
    worst = max([e for e in named if e[1] != HELD] or named, key=lambda e: e[2], default=None)
    held = dict((n, b) for n, b in phases[peak_phase]["excess"]).get(HELD, 0) if peak_phase else 0
    return {"mode": meter.mode, "bare_runtime": bare, "floor": terms, "phases": phases, "whole_peak": whole,
            "held_on_entry": held,
            "ratio": whole / total if total else None, "peak_phase": peak_phase,
            "biggest_excess": list(worst) if worst else None}


def fullest(first: dict[str, int], last: dict[str, int], meter: PhaseMeter | None = None) -> dict[str, int]:
    """Two memory reports merged: the first step's categories (gradients were live then), the higher peak; on
    CUDA ``meter``'s whole-run peak (the meter resets the allocator's mark the reports read at each phase)."""
    if not (first or last):
        return {}
    peak = max(first.get("peak", 0), last.get("peak", 0))
    if meter is not None and meter.mode == "cuda":
        peak = meter.whole_peak()
    return {**last, **first, "peak": peak}


def strategy_memory(strategy: Any) -> dict[str, int]:
    """``Strategy.memory`` (local); a report that fails must not fail the run: then empty."""
    try:
        return {k: int(v) for k, v in strategy.memory().items()}
    except Exception:  # noqa: BLE001 - a measurement only
        return {}


def activation_peak(meter: PhaseMeter, memory: dict[str, int], saved_peak: int) -> int:
    """Saved-tensor high-water mark ``saved_peak`` (CPU); on a GPU the allocator's run peak beyond the model
    states of ``memory``."""
    if meter.mode != "cuda":
        return saved_peak
    states = sum(memory.get(k, 0) for k in ("params", "grads", "optimizer"))
    return max(0, meter.whole_peak() - states)


def rank_ledger(meter: PhaseMeter, bare: int, cfg: Any, pp_rank: int, activation_peak: int,
                memory: dict[str, int] | None = None) -> dict[str, Any]:
    """``ledger`` of this rank with its floor (``rank_floor_of``) and, with ``parallel.offload``, where its model
    states live (``placement``: bytes in host memory and on the device; on CPU ranks both are the one memory). A
    ledger that fails must not fail the run: then the error, in one line. Local."""
    try:
        book = ledger(meter, bare, rank_floor_of(cfg, pp_rank), activation_peak)
        if memory and "offloaded" in memory:
            states = sum(memory.get(k, 0) for k in ("params", "grads", "optimizer"))
            book["placement"] = {"host": memory["offloaded"], "device": max(0, states - memory["offloaded"]),
                                 "offload": cfg.parallel.offload}
        return book
    except Exception as exc:  # noqa: BLE001 - a measurement only
        return {"error": f"{type(exc).__name__}: {exc}"}
