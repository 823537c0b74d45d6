"""Gradient bucket plans: which parameters share one flat all-reduce buffer, and in what order.

Small gradients are fused into buckets because every collective pays a fixed latency (tens of µs on a
network, more over loopback gloo) and small messages waste bandwidth. A bucket is reduced as one flat
tensor, so all its members must share a dtype and a device (the *key*).

Parameters are walked in the order their gradients are expected to become ready during backward: reverse
registration order at first (the last layer's gradients are produced first), then the order actually
observed in the first iteration. A bucket closes once it holds at least its byte cap; the first bucket has a
smaller cap so that communication starts early in backward. Everything here is pure (no processes) and is
unit-tested alone; ``DataParallel`` only executes the plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

__all__ = ["BucketPlan", "plan_buckets", "observed_order", "default_order"]


@dataclass(frozen=True)
class BucketPlan:
    """A list of buckets of parameter indices, in launch order (plain data)."""

    buckets: tuple[tuple[int, ...], ...]
    """Parameter indices of each bucket; within a bucket, their order in the flat buffer."""

    def bucket_of(self) -> dict[int, tuple[int, int]]:
        """``{param index: (bucket index, position inside the bucket)}``."""
        return {p: (b, k) for b, members in enumerate(self.buckets) for k, p in enumerate(members)}

    def __len__(self) -> int:
        return len(self.buckets)


def default_order(num_params: int) -> list[int]:
    """Reverse registration order: about the order in which backward produces the gradients."""
    return list(range(num_params - 1, -1, -1))


def observed_order(ready: Sequence[int], num_params: int) -> list[int]:
    """The ready order seen in one backward, made complete: each index once (first sighting), then the
    indices never seen (unused parameters) in reverse registration order."""
    seen: dict[int, None] = {}
    for i in ready:
        if not 0 <= i < num_params:
            raise ValueError(f"ready index {i} is outside 0..{num_params - 1}")
        seen.setdefault(i, None)
    rest = [i for i in default_order(num_params) if i not in seen]
    return list(seen) + rest


def plan_buckets(nbytes: Sequence[int], keys: Sequence[Hashable], *, cap_bytes: int, first_cap_bytes: int,
                 order: Sequence[int] | None = None) -> BucketPlan:
    """Assign parameters to buckets.

    ``nbytes[i]`` is parameter ``i``'s gradient size in bytes and ``keys[i]`` its (dtype, device): only equal
    keys share a bucket. Parameters are taken in ``order`` (default: reverse registration); each joins the
    open bucket of its key, which closes once it holds ``>= cap`` bytes (``first_cap_bytes`` for the first
    bucket to close, ``cap_bytes`` afterwards), so a bucket exceeds its cap by at most one parameter and a
    parameter larger than the cap gets a bucket of its own. Buckets are returned in the order in which they
    become complete (the position in ``order`` of their last member), which is the order they are launched.
    """
    n = len(nbytes)
    if len(keys) != n:
        raise ValueError(f"got {n} sizes but {len(keys)} keys; give one (dtype, device) key per parameter")
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be > 0 bytes, got cap_bytes={cap_bytes}, "
                         f"first_cap_bytes={first_cap_bytes}")
    walk = default_order(n) if order is None else list(order)
    if sorted(walk) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}, got {walk}")
    position = {p: k for k, p in enumerate(walk)}
    closed: list[list[int]] = []
    open_: dict[Hashable, list[int]] = {}
    open_bytes: dict[Hashable, int] = {}
    for p in walk:
        key = keys[p]
        open_.setdefault(key, []).append(p)
        open_bytes[key] = open_bytes.get(key, 0) + nbytes[p]
        if open_bytes[key] >= (first_cap_bytes if not closed else cap_bytes):
            closed.append(open_.pop(key))
            open_bytes.pop(key)
    closed.extend(members for members in open_.values())
    closed.sort(key=lambda members: position[members[-1]])
    return BucketPlan(buckets=tuple(tuple(b) for b in closed))
