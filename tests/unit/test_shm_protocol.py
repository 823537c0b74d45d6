"""The shared-memory protocol without processes: the members of a group are threads of this process, each
with its own mapping of one segment. Tiny regions and two slots force many pieces and slot reuse; results
are compared with a left-to-right fold computed here."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import reduce
from typing import Callable

import pytest
import torch

from shardwise.comm.ops import shard_offsets
from shardwise.comm.shm import ShmGroup, reduce_ordered
from shardwise.comm.shm_futex import FUTEX_AVAILABLE
from shardwise.comm.shm_segment import ARRIVE, SegmentLayout, attach_segment, create_segment, unlink_segment
from shardwise.comm.shm_sync import Peer, ShmPeerError, WaitPolicy, process_start_time

POLICY = WaitPolicy(spin_s=0.0, yield_s=1e-3, check_s=0.01)


def members(n: int, region: int = 128, slots: int = 2) -> list[ShmGroup]:
    layout = SegmentLayout(n, slots, region)
    first = create_segment(layout)
    segs = [first] + [attach_segment(first.name, layout) for _ in range(n - 1)]
    unlink_segment(first.name)
    pid = os.getpid()
    peers = [Peer(100 + c, c, pid, process_start_time(pid)) for c in range(n)]
    return [ShmGroup(seg, peers, c, "dp", 30.0, POLICY) for c, seg in enumerate(segs)]


def run(groups: list[ShmGroup], fn: Callable[[ShmGroup], object]) -> list[object]:
    with ThreadPoolExecutor(len(groups)) as pool:
        return [f.result(timeout=60) for f in [pool.submit(fn, g) for g in groups]]


def data(c: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * c + length)
    if dtype.is_floating_point:
        return (torch.randn(length, generator=g) * 100).to(dtype)
    return torch.randint(0, 200, (length,), generator=g).to(dtype)


def fold(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    """Left-to-right reduction in the tensors' dtype: the order the protocol promises."""
    if op in ("sum", "avg"):
        out = reduce(lambda a, b: a + b, xs)
        return out / len(xs) if op == "avg" else out
    return reduce(torch.maximum if op == "max" else torch.minimum, xs)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_all_reduce_is_the_ordered_fold_on_every_member(n, dtype):
    groups = members(n)
    for op in ("sum", "avg", "max", "min") if dtype.is_floating_point else ("sum", "max", "min"):
        for length in (1, 7, 31, 32, 33, 257):  # 128 B regions: up to 32 floats (128 uint8) per piece
            xs = [data(c, length, dtype) for c in range(n)]
            outs = run(groups, lambda g: _all_reduce(g, xs[g.me].clone(), op))
            want = fold(xs, op)
            for out in outs:
                assert torch.equal(out, want), (op, length)  # bit-identical on every member
    assert len({g.seq for g in groups}) == 1 and groups[0].seq > 20  # many pieces through 2 slots


def _all_reduce(g: ShmGroup, x: torch.Tensor, op: str) -> torch.Tensor:
    g.all_reduce(x, op, 1 << 30)
    return x


def test_small_messages_take_the_one_wait_path_and_agree():
    groups = members(3, region=1 << 12)
    xs = [data(c, 100, torch.float32) for c in range(3)]
    outs = run(groups, lambda g: _all_reduce(g, xs[g.me].clone(), "sum"))
    assert all(torch.equal(o, fold(xs, "sum")) for o in outs) and groups[0].seq == 1


@pytest.mark.parametrize("n", [2, 3])
def test_reduce_scatter_uneven(n):
    groups = members(n)
    for length in (0, 1, 2 * n + 1, 100):
        offsets = shard_offsets(length, n)
        xs = [data(c, length, torch.float32) for c in range(n)]
        outs = run(groups, lambda g: g.reduce_scatter(xs[g.me], "sum", offsets, 1 << 30))
        want = fold(xs, "sum")
        for c, out in enumerate(outs):
            assert torch.equal(out, want[offsets[c]:offsets[c + 1]]), (length, c)


@pytest.mark.parametrize("n", [2, 3])
def test_all_gather_uneven_and_broadcast(n):
    groups = members(n)
    lens = [70, 0, 33][:n]
    offsets = [sum(lens[:j]) for j in range(n + 1)]
    chunks = [data(c, lens[c], torch.int32) for c in range(n)]

    def gather(g: ShmGroup) -> torch.Tensor:
        flat = torch.zeros(offsets[-1], dtype=torch.int32)
        flat[offsets[g.me]:offsets[g.me + 1]] = chunks[g.me]
        g.all_gather(flat, offsets, 1 << 30)
        return flat
    assert all(torch.equal(o, torch.cat(chunks)) for o in run(groups, gather))
    for root in range(n):
        outs = run(groups, lambda g: _broadcast(g, data(g.me, 101, torch.float64), root))
        assert all(torch.equal(o, data(root, 101, torch.float64)) for o in outs)


def _broadcast(g: ShmGroup, x: torch.Tensor, root: int) -> torch.Tensor:
    g.broadcast(x, root, 1 << 30)
    return x


def test_a_member_that_fails_ends_its_peers_waits_and_the_group():
    groups = members(3)

    def call(g: ShmGroup) -> str:
        try:
            if g.me == 2:
                g._guard("all_reduce", lambda: (_ for _ in ()).throw(KeyError("boom")), 0)
            g.all_reduce(torch.ones(100), "sum", 1 << 30)
        except (ShmPeerError, KeyError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"
    out = run(groups, call)
    assert out[2].startswith("KeyError")
    for msg in out[:2]:
        assert msg.startswith("ShmPeerError") and "rank 102 (coordinate 2) left" in msg, msg
    with pytest.raises(ShmPeerError, match="unusable after an earlier failure"):
        groups[0].all_reduce(torch.ones(3), "sum", 1 << 30)


def test_reduce_ordered_folds_left_to_right_into_out():
    a, b, c = torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])
    out = torch.empty(1)
    reduce_ordered(out, [a, b, c], "sum")
    assert out.item() == ((a + b) + c).item() == 0.0  # (1e8 + 1) rounds back to 1e8 in float32
    reduce_ordered(out, [c, a, b], "sum")
    assert out.item() == 1.0  # another order, another float result: the order is part of the contract
    x = torch.tensor([3.0, -1.0])
    reduce_ordered(x, [x, torch.tensor([1.0, 5.0])], "max")  # out may be parts[0]
    assert x.tolist() == [3.0, 5.0]
    reduce_ordered(out, [torch.tensor([2.0])], "avg")
    assert out.item() == 2.0


@pytest.mark.skipif(not FUTEX_AVAILABLE, reason="futexes: Linux x86-64")
def test_a_sleeping_waiter_is_woken_by_the_publish():
    # Sleeps last up to 60 s here, so only the publisher's wake-up can end the wait within the join below.
    groups = members(2)
    policy = WaitPolicy(spin_s=0.0, yield_s=0.0, sleep_min_s=60.0, sleep_max_s=60.0, futex_timeout_s=60.0)
    for g in groups:
        g.waiter.policy = policy
    waiter = threading.Thread(target=groups[1].waiter.wait, args=(ARRIVE, 1, (0,), "all_reduce"))
    waiter.start()
    for _ in range(1000):  # until it announced its sleep on coordinate 0's ARRIVE counter
        if groups[0].seg.words[groups[0]._sleepers[0]] == groups[0]._mine[ARRIVE] + 1:
            break
        time.sleep(0.01)
    else:
        raise AssertionError("the waiter never went to sleep")
    groups[0]._publish(ARRIVE, 1)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
