"""Objects made inside a captured forward (``capture.py``): state of one call, made anew for every replay.

A Hugging Face decoder with ``use_cache=True`` makes a ``DynamicCache`` inside its forward and passes it to
every layer, which appends its keys and values. Replayed as a constant, one call's keys would reach the next
call's attention. The capture therefore keeps such an object as a ``Made`` marker and a ``Remake``: a copy of
the object as it was when first passed on, taken before any module wrote to it. Each replay (a stage's forward
for one micro-batch, and a checkpointed module's recomputation) copies that anew. The objects it refers to that
existed before the forward (its config, modules, classes) are shared, never copied: ``reachable`` finds them,
and a copy's ``deepcopy`` memo maps each to itself.

What "made inside the forward" means: not among ``gc.get_objects()`` taken just before the forward (the
capture holds that list, so no new object can reuse an old id), tracked by the garbage collector (plain
numbers and strings are not) and not callable (functions, classes and modules are code, not state).
"""

from __future__ import annotations

import ast
import copy
import gc
import inspect
import linecache
import os
import textwrap
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import Tensor

__all__ = ["Made", "Remake", "reachable", "model_frames", "where_made"]


@dataclass(frozen=True)
class Made:
    """An object made inside the forward (in arguments or the output): every replay makes its own, ``Graph.made``."""

    index: int


@dataclass
class Remake:
    """How an object made inside the forward is made anew per call: a deep copy of ``template`` (the object as it
    was first passed on) that shares ``shared`` (the objects it refers to that existed before the forward)."""

    kind: str
    where: str
    template: Any
    shared: dict[int, Any]

    def new(self) -> Any:
        return copy.deepcopy(self.template, dict(self.shared))


INTERNAL = tuple(os.path.dirname(p) + os.sep for p in (os.path.dirname(os.path.dirname(__file__)), torch.__file__))
"""Where shardwise's and torch's own code lives (frames there are not the model's)."""


def reachable(obj: Any, before: set[int]) -> tuple[dict[int, Any], list[Tensor]]:
    """What ``obj`` refers to, through objects newer than ``before``: the older objects (id -> object: its copies
    share them) and the newer tensors (which it holds)."""
    shared: dict[int, Any] = {}
    held: list[Tensor] = []
    stack, seen = [obj], {id(obj)}
    while stack:
        for x in gc.get_referents(stack.pop()):
            if id(x) not in seen:
                seen.add(id(x))
                if id(x) in before:
                    shared[id(x)] = x
                elif isinstance(x, Tensor):
                    held.append(x)
                elif gc.is_tracked(x):
                    stack.append(x)
    return shared, held


def model_frames() -> Iterator[Any]:
    """The frames of the model's code on the stack, innermost first (not shardwise's, not torch's)."""
    frame = inspect.currentframe()
    while frame is not None:
        if not frame.f_code.co_filename.startswith(INTERNAL):
            yield frame
        frame = frame.f_back


def where_made(obj: Any) -> str:
    """``file:line (source)`` of the last assignment to a name bound to ``obj`` in the innermost model frame that
    holds it (else that frame's current line; "the forward's output" when none holds it)."""
    holder = None
    for frame in model_frames():
        file, now = frame.f_code.co_filename, frame.f_lineno
        names = {n for n, v in frame.f_locals.items() if v is obj}
        if names:
            holder = holder or f"{file}:{now} ({linecache.getline(file, now).strip()})"
            line = _assigned_at(frame, names)
            if line is not None:
                return f"{file}:{line} ({linecache.getline(file, line).strip()})"
    return holder or "the forward's output"


def _assigned_at(frame: Any, names: set[str]) -> int | None:
    """The last line, at or before ``frame``'s current one, of its function that assigns one of ``names``."""
    try:
        lines, start = inspect.getsourcelines(frame.f_code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    found = [max(start, 1) + node.lineno - 1 for node in ast.walk(tree)
             if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr))
             and any(isinstance(n, ast.Name) and n.id in names
                     for t in getattr(node, "targets", [getattr(node, "target", None)]) for n in ast.walk(t))]
    return max((line for line in found if line <= frame.f_lineno), default=None)
