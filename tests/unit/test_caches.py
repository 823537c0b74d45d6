"""Process-wide caches stay bounded: the op-dispatch decision caches (an LRU) and the ring's scratch buffers
(per thread, a few per thread, freed with the thread). Pure: no processes, no communication."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch

from shardwise.comm import ring
from shardwise.sbp import dispatch
from shardwise.sbp.lru import LRU


def test_lru_never_holds_more_than_maxsize_and_drops_the_least_recent():
    cache: LRU[int, str] = LRU(3)
    for i in range(100):
        cache.put(i, str(i))
        assert len(cache) <= 3
    assert [k in cache for k in (96, 97, 98, 99)] == [False, True, True, True]
    assert cache.get(97) == "97"  # read: now the most recent, so 98 goes next
    cache.put(100, "100")
    assert 97 in cache and 98 not in cache and cache.get(98) is None


def test_lru_rejects_a_useless_size():
    with pytest.raises(ValueError, match="maxsize"):
        LRU(0)


def test_dispatch_caches_are_bounded():
    for cache in (dispatch._CACHE, dispatch._FAST):
        assert isinstance(cache, LRU) and cache.maxsize == dispatch._CACHE_SIZE
    before = dispatch._FAST
    try:
        dispatch._FAST = LRU(dispatch._CACHE_SIZE)
        for i in range(dispatch._CACHE_SIZE + 500):  # distinct calls, as a process meeting new shapes makes
            dispatch._FAST.put((torch.add, i), (None, "add"))  # type: ignore[arg-type]
        assert len(dispatch._FAST) == dispatch._CACHE_SIZE
    finally:
        dispatch._FAST = before


def test_ring_scratch_keeps_a_few_buffers_per_thread():
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.int8]
    for dtype in dtypes * 3:
        buf = ring.scratch(16, dtype, torch.device("cpu"))
        assert buf.numel() == 16 and buf.dtype == dtype
        assert len(ring._thread_buffers()) <= ring._SCRATCH_PER_THREAD
    again = ring.scratch(8, torch.int8, torch.device("cpu"))  # the most recent buffer is reused, not reallocated
    assert again.data_ptr() == ring._thread_buffers()[(torch.int8, torch.device("cpu"))].data_ptr()


def test_ring_scratch_of_a_finished_thread_is_freed():
    refs: list[weakref.ref] = []

    def work() -> None:
        ring.scratch(1 << 10, torch.float32, torch.device("cpu"))
        refs.append(weakref.ref(ring._thread_buffers()[(torch.float32, torch.device("cpu"))]))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    gc.collect()
    assert refs and refs[0]() is None
