"""kvdepot.server.pool.ExtentAllocator: first fit, alignment, coalescing, accounting."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepot.server.pool import ALIGN_BYTES, ExtentAllocator

A = ALIGN_BYTES


def test_alignment_and_rounding():
    alloc = ExtentAllocator(10 * A)
    assert alloc.alloc(1) == 0
    assert alloc.alloc(A) == A  # the 1-byte extent took a whole aligned unit
    assert alloc.alloc(A + 1) == 2 * A
    assert alloc.used_bytes == 4 * A and alloc.free_bytes == 6 * A
    assert alloc.alloc(3 * A - 5) == 4 * A


@pytest.mark.parametrize("align", [1, 16, 4096])
def test_custom_alignment(align):
    alloc = ExtentAllocator(100 * align + align - 1, align_bytes=align)
    assert alloc.capacity_bytes == 100 * align  # rounded down to whole units
    sizes = (1, align + 1, 3, 2 * align)
    rounded = [-(-n // align) * align for n in sizes]
    offsets = [alloc.alloc(n) for n in sizes]
    assert all(o % align == 0 for o in offsets)
    assert offsets == [sum(rounded[:i]) for i in range(len(sizes))]
    assert alloc.used_bytes == sum(rounded)


def test_first_fit_takes_the_lowest_hole_that_fits():
    alloc = ExtentAllocator(16 * A)
    a, b, c, d, e = (alloc.alloc(n * A) for n in (1, 3, 1, 2, 1))
    assert (a, b, c, d, e) == (0, A, 4 * A, 5 * A, 7 * A)
    alloc.free(b)  # hole of 3 at A
    alloc.free(d)  # hole of 2 at 5A
    assert alloc.alloc(2 * A) == A  # the first hole that fits, not the best fit (5A)
    assert alloc.alloc(2 * A) == 5 * A  # A..3A left only 1 unit at 3A
    assert alloc.alloc(A) == 3 * A
    assert alloc.alloc(4 * A) == 8 * A  # the tail
    assert alloc.alloc(5 * A) is None  # 4 units left in the tail


def test_returns_none_when_full():
    alloc = ExtentAllocator(4 * A)
    assert [alloc.alloc(A) for _ in range(4)] == [0, A, 2 * A, 3 * A]
    assert alloc.alloc(1) is None
    assert alloc.free_bytes == 0 and alloc.num_free_extents == 0
    alloc.free(2 * A)
    assert alloc.alloc(2 * A) is None  # free bytes exist but not contiguously
    assert alloc.alloc(A) == 2 * A


def test_fragmented_free_space_is_not_enough():
    alloc = ExtentAllocator(6 * A)
    offs = [alloc.alloc(A) for _ in range(6)]
    for o in offs[::2]:
        alloc.free(o)
    assert alloc.free_bytes == 3 * A and alloc.num_free_extents == 3
    assert alloc.alloc(2 * A) is None


def test_zero_capacity():
    alloc = ExtentAllocator(A - 1)
    assert alloc.capacity_bytes == 0 and alloc.num_free_extents == 0
    assert alloc.alloc(1) is None


@pytest.mark.parametrize("bad", [0, -1])
def test_invalid_sizes(bad):
    alloc = ExtentAllocator(4 * A)
    with pytest.raises(ValueError):
        alloc.alloc(bad)
    with pytest.raises(ValueError):
        ExtentAllocator(-1)


@pytest.mark.parametrize("order", ["prev-next", "next-prev"])
def test_coalescing_with_both_neighbours(order):
    alloc = ExtentAllocator(5 * A)
    a, b, c, d, e = (alloc.alloc(A) for _ in range(5))
    first, second = (b, d) if order == "prev-next" else (d, b)
    alloc.free(first)
    alloc.free(second)
    assert alloc.num_free_extents == 2
    alloc.free(c)  # joins b .. d into one extent
    assert alloc.num_free_extents == 1
    assert alloc.alloc(3 * A) == b
    assert alloc.alloc(A) is None


def test_coalescing_with_one_neighbour_and_the_tail():
    alloc = ExtentAllocator(8 * A)
    a, b, c = (alloc.alloc(A) for _ in range(3))  # tail free: 3A..8A
    alloc.free(c)  # joins the tail
    assert alloc.num_free_extents == 1
    alloc.free(a)  # no free neighbour (b is allocated)
    assert alloc.num_free_extents == 2
    alloc.free(b)  # joins a and the tail
    assert alloc.num_free_extents == 1
    assert alloc.alloc(8 * A) == 0


def test_double_free_raises():
    alloc = ExtentAllocator(4 * A)
    a = alloc.alloc(A)
    b = alloc.alloc(A)
    alloc.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(a)
    with pytest.raises(ValueError):
        alloc.free(b + 1)  # not the start of an extent
    with pytest.raises(ValueError):
        alloc.free(3 * A)  # never allocated
    assert alloc.used_bytes == A  # failed frees changed nothing
    alloc.free(b)
    assert alloc.used_bytes == 0 and alloc.num_free_extents == 1


@settings(max_examples=200, deadline=None)
@given(
    capacity_units=st.integers(0, 64),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 12 * 64), st.integers(0, 10**6)), max_size=80),
)
def test_random_alloc_free(capacity_units, ops):
    """Random alloc/free: extents never overlap, stay aligned and inside the arena, the byte
    accounting holds, and a request that fits in a free extent never fails."""
    align = 64
    alloc = ExtentAllocator(capacity_units * align, align_bytes=align)
    live: dict[int, int] = {}  # start -> rounded size
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            need = -(-size // align) * align
            free_runs = _free_runs(alloc.capacity_bytes, live)
            off = alloc.alloc(size)
            first_fit = next((s for s, n in free_runs if n >= need), None)
            assert off == first_fit
            if off is not None:
                live[off] = need
        else:
            start = sorted(live)[pick % len(live)]
            alloc.free(start)
            del live[start]
        _check(alloc, live)
    for start in list(live):
        alloc.free(start)
        del live[start]
        _check(alloc, live)
    assert alloc.used_bytes == 0
    if alloc.capacity_bytes:
        assert alloc.num_free_extents == 1
        assert alloc.alloc(alloc.capacity_bytes) == 0
    else:
        assert alloc.num_free_extents == 0


def _free_runs(capacity: int, live: dict[int, int]) -> list[tuple[int, int]]:
    """Maximal free runs (start, size) in address order, from the live extents."""
    runs, pos = [], 0
    for s in sorted(live):
        if s > pos:
            runs.append((pos, s - pos))
        pos = s + live[s]
    if capacity > pos:
        runs.append((pos, capacity - pos))
    return runs


def _check(alloc: ExtentAllocator, live: dict[int, int]) -> None:
    pos = 0
    for s in sorted(live):
        assert s % alloc.align_bytes == 0
        assert s >= pos, "overlapping extents"
        pos = s + live[s]
    assert pos <= alloc.capacity_bytes
    assert alloc.used_bytes == sum(live.values())
    assert alloc.free_bytes == alloc.capacity_bytes - alloc.used_bytes
    # fully coalesced: one free extent per maximal free run
    assert alloc.num_free_extents == len(_free_runs(alloc.capacity_bytes, live))


def test_segments_are_never_crossed_and_coalescing_stops_at_them():
    """L1 is page-locked one segment per cudaHostRegister; one DMA cannot span two."""
    seg = 4 * ALIGN_BYTES
    a = ExtentAllocator(10 * ALIGN_BYTES, segment_bytes=seg)
    got = [a.alloc(3 * ALIGN_BYTES) for _ in range(3)]
    assert got == [0, seg, None]  # 3 pages are free at 3-4 and 7-10, but only across a boundary
    assert a.alloc(2 * ALIGN_BYTES) == 2 * seg  # the last segment has only 2 pages
    for off in got[:2]:
        a.free(off)
    a.free(2 * seg)
    assert a.num_free_extents == 3  # one per segment, never merged across
    assert a.alloc(5 * ALIGN_BYTES) is None  # larger than a segment


def test_alloc_limit_restricts_to_the_pinned_prefix():
    seg = 4 * ALIGN_BYTES
    a = ExtentAllocator(12 * ALIGN_BYTES, segment_bytes=seg)
    assert a.alloc(seg, limit_bytes=0) is None
    assert a.alloc(seg, limit_bytes=seg) == 0
    assert a.alloc(ALIGN_BYTES, limit_bytes=seg) is None
    assert a.alloc(ALIGN_BYTES, limit_bytes=2 * seg) == seg


def test_a_segment_gap_keeps_extents_of_different_segments_apart():
    """HostPool's allocator leaves the last page of every segment but the last free: the kernel
    library merges copies that continue each other, and a merged copy must not run from one
    cudaHostRegister segment into the next."""
    seg = 4 * ALIGN_BYTES
    a = ExtentAllocator(12 * ALIGN_BYTES, segment_bytes=seg, segment_gap_bytes=ALIGN_BYTES)
    got = []
    while (off := a.alloc(ALIGN_BYTES)) is not None:
        got.append(off)
    assert got == [x * ALIGN_BYTES for x in (0, 1, 2, 4, 5, 6, 8, 9, 10, 11)]
    assert a.free_bytes == 0  # the two gap pages are never free to allocate
    for off in got:
        a.free(off)
    assert a.free_bytes == 10 * ALIGN_BYTES
    assert a.num_free_extents == 3 and a.alloc(4 * ALIGN_BYTES) == 8 * ALIGN_BYTES  # the last segment is whole
    assert a.alloc(4 * ALIGN_BYTES) is None and a.alloc(3 * ALIGN_BYTES) == 0
    with pytest.raises(ValueError):
        ExtentAllocator(12 * ALIGN_BYTES, segment_bytes=seg, segment_gap_bytes=100)
