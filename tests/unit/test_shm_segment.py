"""The shared-memory segment's layout (pure arithmetic) and its file's life: created, attached, unlinked."""

from __future__ import annotations

import os

import pytest

from shardwise.comm.shm_segment import (ABORT, ARRIVE, DONE, LINE, NAME_PREFIX, REDUCED, SHM_DIR, SegmentLayout,
                                        attach_segment, create_segment, unlink_segment)


@pytest.mark.parametrize("n,slots,region", [(1, 1, 128), (2, 4, 1 << 20), (3, 2, 384), (8, 4, 4096)])
def test_layout_regions_tile_the_segment_without_overlap(n, slots, region):
    lay = SegmentLayout(n, slots, region)
    spans = sorted((lay.region_offset(s, r), lay.region_offset(s, r) + region)
                   for s in range(slots) for r in range(n + 1))
    assert spans[0][0] == lay.data_offset >= LINE + n * LINE  # after the header and every rank's counters
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, disjoint
    assert spans[-1][1] == lay.total_bytes
    assert all(start % LINE == 0 for start, _ in spans)  # aligned for every dtype's view


def test_counters_get_one_line_per_rank():
    lay = SegmentLayout(4, 2, 256)
    idx = {(r, f): lay.counter_index(r, f) for r in range(4) for f in (ARRIVE, REDUCED, DONE, ABORT)}
    assert len(set(idx.values())) == len(idx)
    for (r, _), i in idx.items():  # rank r's counters sit in its own 128-byte line, inside the counter area
        assert (i * 8 - lay.counters_offset) // LINE == r
        assert lay.counters_offset <= i * 8 < lay.data_offset


@pytest.mark.parametrize("args,word", [((0, 1, 128), "n >= 1"), ((2, 0, 128), "slots"), ((2, 1, 100), "multiple"),
                                       ((2, 1, 0), "multiple")])
def test_bad_layout_is_a_clear_error(args, word):
    with pytest.raises(ValueError, match=word):
        SegmentLayout(*args)


def test_create_attach_unlink_round_trip():
    lay = SegmentLayout(2, 2, 256)
    seg = create_segment(lay)
    path = os.path.join(SHM_DIR, seg.name)
    try:
        assert seg.name.startswith(NAME_PREFIX) and os.path.getsize(path) == lay.total_bytes
        other = attach_segment(seg.name, lay)
        seg.write(1, DONE, 12345)
        seg.buf[lay.region_offset(1, 2)] = 7
        assert other.read(1, DONE) == 12345 and other.buf[lay.region_offset(1, 2)] == 7  # one memory
        with pytest.raises(ValueError, match="bytes"):
            attach_segment(seg.name, SegmentLayout(2, 3, 256))
        with pytest.raises(ValueError, match="not a shardwise"):
            attach_segment("../etc/passwd", lay)
    finally:
        unlink_segment(seg.name)
    assert not os.path.exists(path)
    seg.write(0, ARRIVE, 3)  # the mapping outlives the file
    assert seg.read(0, ARRIVE) == 3
    unlink_segment(seg.name)  # a second unlink is harmless


def test_attach_refuses_a_file_without_the_magic():
    lay = SegmentLayout(2, 1, 128)
    seg = create_segment(lay)
    try:
        seg.words[0] = 0
        with pytest.raises(ValueError, match="not a shardwise segment"):
            attach_segment(seg.name, lay)
    finally:
        unlink_segment(seg.name)
