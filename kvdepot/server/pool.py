"""L1 host memory pool: one arena of ``capacity_bytes`` and an extent allocator over it.

Objects of one model all have one size, so first-fit over an address-ordered free list with
coalescing keeps fragmentation near zero; mixed sizes (several models) still coalesce back
into large extents as objects are freed. Every extent is aligned to ``ALIGN_BYTES`` (page
size: 16-byte vector copies, and O_DIRECT for a disk tier).

Capacity exhaustion is not an error: `alloc` returns None and the caller evicts or skips.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading

import logging

import torch

log = logging.getLogger("kvdepot.pool")

ALIGN_BYTES = 4096


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ExtentAllocator:
    """First-fit allocator of aligned byte extents in ``[0, capacity_bytes)``.

    Free extents are kept address-ordered (``_starts`` sorted, ``_sizes[start]``) and
    coalesced with both neighbours on free. With ``segment_bytes`` no extent ever crosses a
    multiple of it (the L1 arena is page-locked one segment per ``cudaHostRegister`` call, and
    one async copy cannot span two registrations). ``segment_gap_bytes``: that many bytes at the
    end of every segment but the last are never allocated, so that no two extents of different
    segments are adjacent in memory: the kernel library merges copies whose host and device
    sides both continue the copy before into one (`dma_issue` in ``kvd_lanes.cuh``), and such a
    merged copy must not run into the next registration. Not thread-safe: the event loop owns it.
    """

    def __init__(self, capacity_bytes: int, align_bytes: int = ALIGN_BYTES, segment_bytes: int | None = None,
                 segment_gap_bytes: int = 0) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        if segment_bytes is not None and (segment_bytes <= 0 or segment_bytes % align_bytes):
            raise ValueError("segment_bytes must be a positive multiple of align_bytes")
        self.align_bytes = align_bytes
        self.capacity_bytes = capacity_bytes // align_bytes * align_bytes
        self.segment_bytes = segment_bytes or max(self.capacity_bytes, align_bytes)
        seg = self.segment_bytes
        self._starts: list[int] = list(range(0, self.capacity_bytes, seg))
        if segment_gap_bytes < 0 or segment_gap_bytes % align_bytes or (
                segment_gap_bytes >= seg and self.capacity_bytes > seg):
            raise ValueError("segment_gap_bytes must be a multiple of align_bytes below segment_bytes")
        self._sizes: dict[int, int] = {s: min(seg, self.capacity_bytes - s) - (
            segment_gap_bytes if s + seg < self.capacity_bytes else 0) for s in self._starts}
        self._allocated: dict[int, int] = {}  # start -> size (rounded)
        self.used_bytes = 0
        self.allocatable_bytes = sum(self._sizes.values())  # capacity less the segment gaps

    def alloc(self, size_bytes: int, limit_bytes: int | None = None) -> int | None:
        """Offset of a new extent of at least ``size_bytes``, or None if no free extent fits.
        ``limit_bytes``: only extents that end at or below it (the pinned part of L1)."""
        if size_bytes <= 0:
            raise ValueError("size_bytes must be > 0")
        a = self.align_bytes
        need = (size_bytes + a - 1) // a * a  # (`_round_up`, inline: every store allocates)
        limit = self.capacity_bytes if limit_bytes is None else limit_bytes
        for i, start in enumerate(self._starts):
            if start + need > limit:
                return None
            have = self._sizes[start]
            if have >= need:
                del self._sizes[start]
                if have == need:
                    del self._starts[i]
                else:
                    self._starts[i] = start + need
                    self._sizes[start + need] = have - need
                self._allocated[start] = need
                self.used_bytes += need
                return start
        return None

    def free(self, start: int) -> None:
        """Return the extent that `alloc` returned at ``start``.

        Raises:
            ValueError: ``start`` is not an allocated extent (double free).
        """
        try:
            size = self._allocated.pop(start)
        except KeyError:
            raise ValueError(f"extent at {start} is not allocated") from None
        self.used_bytes -= size
        i = bisect.bisect_left(self._starts, start)
        seg = self.segment_bytes
        # coalesce with the next free extent (same segment only)
        if i < len(self._starts) and self._starts[i] == start + size and (start + size) % seg:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        # coalesce with the previous free extent (same segment only)
        if i > 0 and start % seg:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:
                self._sizes[prev] += size
                return
        self._starts.insert(i, start)
        self._sizes[start] = size

    @property
    def free_bytes(self) -> int:
        """Bytes not allocated, less the segment gaps (never allocated)."""
        return self.allocatable_bytes - self.used_bytes

    @property
    def num_free_extents(self) -> int:
        return len(self._starts)


PIN_SEGMENT_BYTES = 2 << 30  # one cudaHostRegister per segment; no object crosses a segment
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault pages in writable without changing their bytes
_PREFAULT_STEP_BYTES = 64 << 20


class HostPool:
    """L1 tier: an anonymous-memory arena (uint8 tensor) handed out as object buffers.

    Start-up is instant for any capacity: the arena is only reserved, and `start_prefault`
    faults its pages in from a background thread in 64 MiB steps (``MADV_POPULATE_WRITE``;
    bytes unchanged, so it is safe while objects are already being written), so the first
    stores do not pay a page fault per 4 KiB. The CUDA path pins the same steps
    progressively.
    """

    name = "l1"

    def __init__(self, capacity_bytes: int, segment_bytes: int = PIN_SEGMENT_BYTES) -> None:
        # a page left free at the end of every segment: no copy the kernel library merges spans two
        self.allocator = ExtentAllocator(capacity_bytes, segment_bytes=min(segment_bytes, max(
            capacity_bytes // ALIGN_BYTES * ALIGN_BYTES, ALIGN_BYTES)), segment_gap_bytes=ALIGN_BYTES)
        self.usable_bytes = self.allocator.capacity_bytes  # shrinks to the pinned part while pinning
        n = self.allocator.capacity_bytes
        self._mmap = mmap.mmap(-1, max(n, mmap.PAGESIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.arena = torch.frombuffer(self._mmap, dtype=torch.uint8)[:n]
        self._base_ptr = self.arena.data_ptr()
        self.prefaulted_bytes = 0
        self.pinned_bytes = 0
        self._pinned_ranges: list[int] = []
        self._prefault_stop = threading.Event()

    def start_prefault(self) -> threading.Thread | None:
        """Fault the arena in from a daemon thread; returns it (None if the kernel lacks
        MADV_POPULATE_WRITE, in which case pages fault on first touch)."""
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            madvise = libc.madvise
        except (OSError, AttributeError):
            return None
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        base, total = self.arena.data_ptr(), self.capacity_bytes
        if total == 0 or madvise(base, min(total, mmap.PAGESIZE), _MADV_POPULATE_WRITE) != 0:
            return None

        def run() -> None:
            for off in range(0, total, _PREFAULT_STEP_BYTES):
                if self._prefault_stop.is_set():
                    return
                if madvise(base + off, min(_PREFAULT_STEP_BYTES, total - off), _MADV_POPULATE_WRITE) != 0:
                    return
                self.prefaulted_bytes = min(off + _PREFAULT_STEP_BYTES, total)

        t = threading.Thread(target=run, name="kvdepot-l1-prefault", daemon=True)
        t.start()
        return t

    def start_pinning(self) -> threading.Thread:
        """Page-lock the arena for DMA from a daemon thread, one segment per
        ``cudaHostRegister`` call (which also faults the pages in), so start-up stays instant
        for any size. Objects are only allocated in segments already pinned (`usable_bytes`),
        and never across two: every copy into L1 is a single-registration DMA."""
        import torch

        cudart = torch.cuda.cudart()
        base, total = self.arena.data_ptr(), self.capacity_bytes
        step_bytes = self.allocator.segment_bytes
        self.pinned_bytes = 0
        self.usable_bytes = 0

        def run() -> None:
            for off in range(0, total, step_bytes):
                if self._prefault_stop.is_set():
                    return
                n = min(step_bytes, total - off)
                err = cudart.cudaHostRegister(base + off, n, 0)
                if int(err) != 0:
                    log.warning("cudaHostRegister of L1 bytes [%d, %d) failed (%s); using the rest pageable",
                                off, off + n, err)
                    self.usable_bytes = total
                    return
                self._pinned_ranges.append(base + off)
                self.pinned_bytes = self.usable_bytes = off + n
            log.info("L1 pinned: %d bytes", total)

        t = threading.Thread(target=run, name="kvdepot-l1-pin", daemon=True)
        t.start()
        return t

    def stop_prefault(self) -> None:
        """Stop background prefaulting / pinning (what is pinned stays pinned)."""
        self._prefault_stop.set()

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def alloc(self, size_bytes: int) -> int | None:
        return self.allocator.alloc(size_bytes, self.usable_bytes)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    @property
    def base_ptr(self) -> int:
        """Host address of arena offset 0."""
        return self._base_ptr

    def view(self, offset: int, size_bytes: int) -> memoryview:
        """Writable memoryview of ``size_bytes`` arena bytes at ``offset`` (file I/O)."""
        return memoryview(self._mmap)[offset : offset + size_bytes]

    def buffer(self, offset: int, size_bytes: int) -> torch.Tensor:
        """uint8 view ``[size_bytes]`` of the arena at ``offset``."""
        return self.arena[offset : offset + size_bytes]
