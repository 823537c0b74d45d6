"""Waiting on counters: returns when peers arrive, and ends with a named error for a dead, aborted or late peer."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from shardwise.comm.shm_segment import ABORT, ARRIVE, DONE, SegmentLayout, create_segment, unlink_segment
from shardwise.comm.shm_sync import (Peer, ShmPeerError, ShmTimeoutError, Waiter, WaitPolicy, peer_alive,
                                     policy_for, process_start_time)

FAST = WaitPolicy(spin_s=1e-5, yield_s=1e-4, sleep_min_s=1e-5, sleep_max_s=1e-3, check_s=0.01)


@pytest.fixture()
def segment():
    seg = create_segment(SegmentLayout(3, 1, 128))
    unlink_segment(seg.name)
    return seg


def _me() -> Peer:
    return Peer(rank=10, coord=0, pid=os.getpid(), start_time=process_start_time(os.getpid()))


def _waiter(seg, peers, timeout_s=60.0) -> Waiter:
    index = [[seg.layout.counter_index(c, f) for c in range(3)] for f in range(4)]
    return Waiter(seg.words, index, peers, 0, FAST, timeout_s, "dp", ABORT)


def _alive_peers() -> list[Peer]:
    me = _me()
    return [me] + [Peer(10 + c, c, me.pid, me.start_time) for c in (1, 2)]  # this live process stands in


def test_wait_returns_once_every_peer_reached_the_target(segment):
    waiter = _waiter(segment, _alive_peers())
    for c in range(3):
        segment.write(c, ARRIVE, 5)
    waiter.wait(ARRIVE, 5, (0, 1, 2), "all_reduce")  # already there: the fast path

    def later() -> None:
        time.sleep(0.05)
        segment.write(2, ARRIVE, 6)
    segment.write(0, ARRIVE, 6)
    segment.write(1, ARRIVE, 6)
    t = threading.Thread(target=later)
    t.start()
    waiter.wait(ARRIVE, 6, (0, 1, 2), "all_reduce")
    t.join()
    assert segment.read(2, ARRIVE) == 6


def test_wait_only_looks_at_the_given_peers(segment):
    segment.write(1, DONE, 3)
    _waiter(segment, _alive_peers()).wait(DONE, 3, (1,), "broadcast")  # coordinates 0 and 2 are at 0


def test_a_late_but_alive_peer_times_out_with_its_rank(segment):
    waiter = _waiter(segment, _alive_peers(), timeout_s=0.1)
    segment.write(1, ARRIVE, 1)
    with pytest.raises(ShmTimeoutError, match=r"for ranks \[12\] \(coordinates \[2\]\)") as err:
        waiter.wait(ARRIVE, 1, (1, 2), "reduce_scatter")
    assert "reduce_scatter" in str(err.value) and "'dp'" in str(err.value)


def test_an_aborted_peer_ends_the_wait(segment):
    segment.write(2, ABORT, 1 + 2)  # coordinate 2 failed by itself
    with pytest.raises(ShmPeerError, match=r"rank 12 \(coordinate 2\) left a shared-memory collective") as err:
        _waiter(segment, _alive_peers()).wait(ARRIVE, 1, (1, 2), "all_gather")
    assert err.value.culprit == 2 and "reported" not in str(err.value)


def test_an_abort_relayed_by_a_peer_names_where_it_started(segment):
    segment.write(1, ABORT, 1 + 2)  # coordinate 1 left because it saw coordinate 2 fail
    with pytest.raises(ShmPeerError, match=r"rank 12 \(coordinate 2\) left .* as reported by rank 11") as err:
        _waiter(segment, _alive_peers()).wait(ARRIVE, 1, (1, 2), "all_gather")
    assert err.value.culprit == 2


def _zombie() -> subprocess.Popen:
    """A child that has exited but is not reaped yet (what a dead rank is until its parent joins it)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    for _ in range(500):
        with open(f"/proc/{child.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return child
        time.sleep(0.01)
    raise AssertionError("child did not exit")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="liveness by /proc (Linux)")
def test_a_dead_peer_ends_the_wait_with_its_rank(segment):
    child = _zombie()
    me = _me()
    dead = Peer(rank=11, coord=1, pid=child.pid, start_time=process_start_time(child.pid))
    peers = [me, dead, Peer(12, 2, me.pid, me.start_time)]
    try:
        died = rf"all_reduce on axis 'dp': rank 11 \(coordinate 1, pid {child.pid}\) died"
        with pytest.raises(ShmPeerError, match=died):
            _waiter(segment, peers).wait(ARRIVE, 1, (1, 2), "all_reduce")
    finally:
        child.wait()
    assert not peer_alive(dead)  # reaped: gone altogether


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="liveness by /proc (Linux)")
def test_liveness_sees_zombies_and_reused_pids():
    me = _me()
    assert me.start_time > 0 and peer_alive(me)
    assert not peer_alive(Peer(0, 0, me.pid, me.start_time + 1))  # same pid, another process
    child = _zombie()
    try:
        assert not peer_alive(Peer(0, 0, child.pid, -1))
    finally:
        child.wait()


def test_oversubscribed_ranks_yield_at_once_instead_of_spinning():
    assert policy_for(4, 2).spin_s == 0 and policy_for(2, 2).spin_s > 0 and policy_for(2, 16).spin_s > 0
    assert policy_for(4, 2).yield_s == policy_for(2, 2).yield_s  # only the spin differs
