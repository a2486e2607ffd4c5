"""Engine-side staging: the engine's process gathers chunks into a device ring it shares with
the daemon, and scatters them out of it; the daemon only moves the ring's bytes over PCIe.

The gather / scatter kernels run on the engine's own stream, ordered with its forward passes by
the stream itself; the daemon's part is DMA only (why: docs/architecture.md, "Why engine-side
staging").

Ring: one device buffer per registration (`Register.staging`), allocated first-in first-out in
256-byte aligned regions. A store's region is free once the daemon's copies out of it ended
(its reply) and its gather has run (its fence word, below); a retrieve's once the engine's
scatter out of it ended (a local event after the scatter). A request that finds no room waits
for the oldest region; one larger than the ring goes the daemon-gathers way instead.
Optionally (`EngineStaging`'s ``load_ring_bytes``) retrieves get a second ring of their own
after the first in the same buffer, numbered in the same sequence, so that a retrieve never
waits for room behind stores still being copied out.

Fence words (`FenceWords`): the store is sent as soon as its gather is enqueued, and the
engine's GPU writes the region's sequence number into a word of host memory shared with the
daemon once the gather has run (enqueued in the gather's own call, `Kernels.engine_gather`);
the daemon polls the word from the CPU and copies the region after it. So a store never waits
for the engine's stream (a vLLM step's forward may still be running on it). Never an
interprocess CUDA event: one can report its record complete before the work ahead of it ran
(`kvdepot.client.staged.Stager.fence`).
"""

from __future__ import annotations

import array
import collections
import ctypes
import functools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import torch

from kvdepot.client.kvcache import export_cuda_storage
from kvdepot.gpu.kernels import KernelError, Kernels, KvdGroupDesc
from kvdepot.gpu.layout import EngineLayout
from kvdepot.protocol.messages import (GATE_DONE_BIT, LANDED_BIT, LANDED_COUNT_SHIFT, LANDED_MAX_CHUNKS,
                                       LANDED_MAX_SEQ, StorageSpec, landed_value)

log = logging.getLogger("kvdepot.client")

DEFAULT_STAGING_BYTES = 256 << 20
FENCE_ABANDONED_BIT = 1 << 63  # a fence word's value | this: the region's gather was given up
_GATED_DONE = LANDED_BIT | GATE_DONE_BIT  # a gated scatter's word once it ran
FENCE_WORDS = 4096  # at most FENCE_WORDS - 1 ring regions live at once (one word per region)
_ALIGN = 256


class StagingRegion:
    """One request's bytes in the ring: [offset, offset + size_bytes). ``is_free()`` says whether
    nothing reads or writes it any more; ``reclaim()`` blocks until then (False: cannot tell,
    e.g. the request was lost in a timeout, and the region stays taken)."""

    __slots__ = ("offset", "size_bytes", "owner", "seq", "fenced", "gated", "is_free", "reclaim")

    def __init__(self, offset: int, size_bytes: int, owner: object = None, seq: int = 0,
                 fenced: bool = False) -> None:
        self.offset = offset
        self.size_bytes = size_bytes
        self.owner = owner  # the client whose request uses it (only it may call reclaim)
        self.seq = seq  # the ring's allocation number (>= 1): a store's fence value
        # a store's gather (or a retrieve's scatter), then the GPU's write of its fence word,
        # is (to be) enqueued
        self.fenced = fenced
        self.gated = False  # a retrieve's scatter waits on the GPU for its landed word
        self.is_free: Callable[[], bool] = lambda: False
        self.reclaim: Callable[[], bool] = lambda: False

    def release(self) -> None:
        """Free at once: no copy will read or write it (e.g. its request was never sent)."""
        self.is_free = lambda: True


class _Numbering:
    """What the rings of one staging buffer share: their regions' numbers (one sequence, so
    that each live region of either ring has a fence word of its own and the daemon's
    `Drain`, which goes by number, covers both) and the lock that guards them."""

    __slots__ = ("lock", "seq", "drained_through", "rings")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seq = 0  # never reset: a fence value is never reused
        # regions up to this number whose requests were lost are settled (a `Drain` answered)
        self.drained_through = 0
        self.rings: list[StagingRing] = []

    def oldest_live(self) -> int | None:
        """The number of the oldest region live in any of the rings (None: none is); takes the
        regions that freed off the front of each (a ring that allocates nothing for a while
        would otherwise keep a freed region's number live). Call with ``lock`` held."""
        oldest = None
        for ring in self.rings:
            live = ring.live
            while live and live[0].is_free():
                live.popleft()
            if live and (oldest is None or live[0].seq < oldest):
                oldest = live[0].seq
        return oldest


class StagingRing:
    """First-in first-out allocator of 256-byte aligned regions in ``size_bytes`` bytes from
    offset ``base`` of the staging buffer (the offsets only; the memory is
    `EngineStaging.buffer`). Thread-safe: several clients (one per thread) may share a
    registration; a region is reclaimed (its reply waited for) only by its own client, and one
    of another client's is polled until free, for at most ``foreign_wait_s``. Regions are
    numbered 1, 2, ... (``seq``), in one sequence with the rings of the same buffer
    (``shares``: `EngineStaging.load_ring` numbers with `EngineStaging.ring`); live regions of
    all of them span at most ``max_live`` numbers, so their ``seq % (max_live + 1)`` differ
    (one fence word each)."""

    def __init__(self, size_bytes: int, foreign_wait_s: float = 1.0, max_live: int = FENCE_WORDS - 1,
                 base: int = 0, shares: StagingRing | None = None) -> None:
        self.size_bytes = size_bytes
        self.base = base
        self.end = base + size_bytes
        self.foreign_wait_s = foreign_wait_s
        self.max_live = max_live
        self.live: collections.deque[StagingRegion] = collections.deque()
        self.head = base  # where the next region starts, if it fits
        self._numbering = shares._numbering if shares is not None else _Numbering()
        self._numbering.rings.append(self)
        self._lock = self._numbering.lock

    @property
    def last_seq(self) -> int:
        """The number of the newest region handed out (0: none yet), by this ring or one it
        shares numbers with."""
        return self._numbering.seq

    @property
    def drained_through(self) -> int:
        """Regions up to this number (of this ring and those it shares numbers with) whose
        requests were lost are settled: a `Drain` through it was answered."""
        return self._numbering.drained_through

    @drained_through.setter
    def drained_through(self, seq: int) -> None:
        self._numbering.drained_through = seq

    def _numbers_for(self, count: int) -> bool:
        """Whether ``count`` more regions may be numbered now (the live ones and they would span
        at most ``max_live`` numbers)."""
        oldest = self._numbering.oldest_live()
        return oldest is None or self._numbering.seq + count - oldest < self.max_live

    def _fit(self, nbytes: int) -> int | None:
        if not self.live:
            self.head = self.base
            return self.base
        tail = self.live[0].offset
        if self.head > tail:  # taken: [tail, head); free: [head, end) and [base, tail)
            if self.head + nbytes <= self.end:
                return self.head
            return self.base if self.base + nbytes <= tail else None
        # wrapped: taken [tail, end) and [base, head); free: [head, tail) (empty when head == tail)
        return self.head if self.head + nbytes <= tail else None

    def reset(self, fence: FenceWords | None = None) -> None:
        """Forget every region the daemon may have copied: call only when no copy of the
        daemon's can touch the ring any more, e.g. after it restarted (without this, regions
        of requests lost with it stay taken for good: the client cannot tell whether their
        copies ran). A store's region whose gather has not run yet, or a retrieve's whose scatter
        has not (``fenced``, its word in ``fence`` not written), stays taken until it has: the
        engine's GPU still writes or reads it."""
        with self._lock:
            keep = collections.deque()
            if fence is not None:
                for r in self.live:
                    if r.gated:  # the daemon that would have written its landed word is gone
                        fence.open_gate(r.seq)
                    if r.fenced and not fence.holds(r.seq):
                        r.is_free = functools.partial(fence.holds, r.seq)
                        r.reclaim = functools.partial(await_word, fence, r.seq, self.foreign_wait_s)
                        keep.append(r)
            self.live = keep
            self.head = keep[-1].offset + keep[-1].size_bytes if keep else self.base

    def alloc(self, nbytes: int, owner: object = None, wait: bool = True,
              fenced: bool = False) -> StagingRegion | None:
        """A region of at least ``nbytes`` for ``owner``'s request; while there is no room it
        reclaims the oldest region (`StagingRegion.reclaim`) if ``owner`` owns it, else polls it.
        None: larger than the ring, or the oldest region cannot be reclaimed in time (the
        caller then goes the daemon-gathers way), or (``wait=False``) no room right now.
        ``fenced``: a store's, whose gather will write its fence word (`reset`)."""
        nbytes = (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        if nbytes > self.size_bytes or nbytes == 0:
            return None
        deadline = None
        while True:
            with self._lock:
                while self.live and self.live[0].is_free():
                    self.live.popleft()
                off = self._fit(nbytes) if self._numbers_for(1) else None
                if off is not None:
                    numbering = self._numbering
                    numbering.seq += 1
                    region = StagingRegion(off, nbytes, owner, numbering.seq, fenced)
                    self.live.append(region)
                    self.head = off + nbytes
                    return region
                oldest = self.live[0]
            if not wait:
                return None
            if oldest.owner is owner:
                if not oldest.reclaim():
                    log.warning("staging ring: the oldest region cannot be reclaimed; this request goes unstaged")
                    return None
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.foreign_wait_s
            elif now > deadline:
                return None
            time.sleep(20e-6)

    def alloc_pieces(self, sizes_bytes: Sequence[int], owner: object = None,
                     fenced: bool = False) -> list[StagingRegion] | None:
        """Regions of ``sizes_bytes``, numbered one after another, for requests whose chunks
        one call gathers (`EngineStaging.gather_pieces`): placed as `alloc` would place them one
        after another (end to end where the ring has the room in one stretch), all or none,
        never waiting. None: no room for all of them now, or a size is 0."""
        if not sizes_bytes or any(n <= 0 for n in sizes_bytes):
            return None
        with self._lock:
            while self.live and self.live[0].is_free():
                self.live.popleft()
            if not self._numbers_for(len(sizes_bytes)):
                return None
            numbering = self._numbering
            head, seq = self.head, numbering.seq
            out = []
            for n in sizes_bytes:
                n = (n + _ALIGN - 1) // _ALIGN * _ALIGN
                off = self._fit(n) if n <= self.size_bytes else None
                if off is None:
                    for _ in out:  # as if none was placed (their numbers were never seen)
                        self.live.pop()
                    self.head, numbering.seq = head, seq
                    return None
                numbering.seq += 1
                region = StagingRegion(off, n, owner, numbering.seq, fenced)
                self.live.append(region)
                self.head = off + n
                out.append(region)
            return out


class FenceWords:
    """``words`` uint64 words of host memory in a sealed memfd, mapped for this process's GPU
    to write (`Kernels.host_register_mapped`) and passed to the daemon (`Register.fence`),
    which polls them. Word ``seq % words`` receives a store region's ``seq`` once its gather
    has run (`signal`), and a retrieve region's once its scatter has run (`EngineStaging.scatter`).

    Raises:
        OSError: no memfd; KernelError: the memory cannot be registered with CUDA.
    """

    def __init__(self, kernels: Kernels, words: int = FENCE_WORDS) -> None:
        from kvdepot.gpu.shm import create_memfd

        self.kernels = kernels
        self.words = words
        self.fd, mem = create_memfd("kvdepot-fence", words * 8)
        self.host_ptr = mem.data_ptr()
        try:
            self.dev_ptr = kernels.host_register_mapped(self.host_ptr, words * 8)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = (ctypes.c_uint64 * words).from_address(self.host_ptr)
        # retired, not unregistered, once closed or collected (`_retire_fence`)
        self._finalizer = weakref.finalize(self, _retire_fence, self.fd, mem)

    def word_ptr(self, seq: int) -> int:
        """The device address of region ``seq``'s word (`Kernels.engine_gather` writes ``seq`` there)."""
        return self.dev_ptr + (seq % self.words) * 8

    def signal(self, seq: int, stream) -> None:
        """Enqueue on ``stream`` the GPU's write of ``seq`` into its word, after the work so far."""
        self.kernels.engine_signal(self.word_ptr(seq), seq, stream.cuda_stream)

    def holds(self, seq: int) -> bool:
        """Whether no GPU write of region ``seq`` is pending: the GPU wrote ``seq`` (its gather or
        scatter ran; a gated scatter's landed value with `GATE_DONE_BIT`), or the engine gave the
        region up (`abandon`)."""
        v = self._view[seq % self.words]
        return v in (seq, seq | FENCE_ABANDONED_BIT) or (v & _GATED_DONE == _GATED_DONE and v & LANDED_MAX_SEQ == seq)

    def landed(self, seq: int) -> bool:
        """Whether region ``seq``'s gated scatter may run (its landed word was written) or ran."""
        v = self._view[seq % self.words]
        return bool(v & LANDED_BIT) and v & LANDED_MAX_SEQ == seq

    def landed_count(self, seq: int) -> int:
        """The chunks region ``seq``'s landed word says are in the ring (call once `landed`)."""
        v = self._view[seq % self.words]
        return (v >> LANDED_COUNT_SHIFT) & LANDED_MAX_CHUNKS if v & LANDED_BIT else 0

    def close_gate(self, seq: int) -> None:
        """Before region ``seq``'s gated scatter is enqueued: clear its word (the region's
        earlier users' values, a store's abandoned mark or a late landed word of a retrieve
        given up, are all settled once the region is handed out again)."""
        self._view[seq % self.words] = 0

    def open_gate(self, seq: int) -> None:
        """Let region ``seq``'s gated scatter (`EngineStaging.scatter_gated`) run and write
        nothing: its retrieve copied nothing, failed or got no reply, so the daemon's DMA stream
        will not write the landed word (`Retrieve.landed`). Leaves a word the daemon already
        wrote, or the scatter's own done value, as it is."""
        if not self.landed(seq):
            self._view[seq % self.words] = landed_value(seq, 0)

    def abandon(self, seq: int) -> None:
        """Tell the daemon from the CPU that region ``seq``'s gather will never run (its launch
        failed after the store was sent): the daemon copies nothing of it and fails the store
        (kvd_dma in the kernel library). Call only when no GPU write of the word is enqueued."""
        self._view[seq % self.words] = seq | FENCE_ABANDONED_BIT

    def close(self) -> None:
        """Retire the words (`_retire_fence`): they stay page-locked and mapped while this
        process lives, and may still be written by GPU work enqueued before."""
        self._finalizer()


def await_word(fence: FenceWords, seq: int, wait_s: float, ready: Callable[[int], bool] | None = None) -> bool:
    """Whether the GPU wrote ``seq`` into its fence word (``ready``: another test of the word,
    e.g. `FenceWords.landed`), polled for up to ``wait_s``."""
    ready = fence.holds if ready is None else ready
    deadline = time.monotonic() + wait_s
    while not ready(seq):
        if time.monotonic() > deadline:
            return False
        time.sleep(20e-6)
    return True


# Fence words closed or collected: kept page-locked and mapped until the process exits. Their
# cudaHostUnregister would wait until the device is idle and hold every other thread's kernel
# launches meanwhile (H200: with a 1-s kernel running, the unregister took 1010 ms, and a
# launch on another stream by another thread waited 960 ms), at whatever point a garbage
# collection ran the finalizer: inside an engine's step, or a transfer thread's. A
# registration's words are FENCE_WORDS * 8 bytes (32 KiB); an engine makes one per
# registration with the daemon (again after each daemon restart).
_RETIRED_FENCES: list[torch.Tensor] = []


def _retire_fence(fd: int, mem: torch.Tensor) -> None:
    os.close(fd)  # (the daemon holds its own descriptor of the memfd)
    _RETIRED_FENCES.append(mem)  # mapped and registered for good: a late GPU write lands in it


class EngineStaging:
    """A registration's engine side: its layer groups in the kernel library (the engine's own
    device pointers) and the staging ring(s): ``ring`` for stores, ``load_ring`` for retrieves
    (the same ring unless ``load_ring_bytes`` is given).

    Args:
        kernels: the kernel library, loaded in the engine's process.
        device: the GPU of the KV caches.
        layout: the registration's `EngineLayout` (from `kvdepot.gpu.layout.group_layers`, the
            same the daemon computes).
        storages: the engine's storage tensors (index = `LayerSpec.storage`); layer offsets are
            relative to their ``data_ptr()``.
        ring_bytes: bytes of the ring (device memory of the engine's GPU).
        load_ring_bytes: 0, or the bytes of a second ring, after the first in the same buffer,
            for retrieves alone: a retrieve then never waits for room behind stores whose
            bytes the daemon is still copying out (a first-in first-out ring frees its regions
            in order), e.g. a prefix hit's load while other prompts' stores fill the link.
            Fewer bytes than one chunk's (``layout.object_bytes``): no second ring (logged).

    Raises:
        KernelError: the library refuses the layout; torch.OutOfMemoryError for the ring.
    """

    def __init__(self, kernels: Kernels, device: torch.device, layout: EngineLayout,
                 storages: Sequence[torch.Tensor], ring_bytes: int = DEFAULT_STAGING_BYTES,
                 load_ring_bytes: int = 0) -> None:
        self.kernels = kernels
        self.device = device
        self.layout = layout
        self.object_bytes = layout.object_bytes
        if 0 < load_ring_bytes < layout.object_bytes:
            log.warning("a %d-byte ring for retrieves cannot hold one %d-byte chunk: retrieves share the ring",
                        load_ring_bytes, layout.object_bytes)
            load_ring_bytes = 0
        # first: a ring the GPU has no room for leaves nothing behind (the library's state below)
        self.buffer = torch.empty(ring_bytes + load_ring_bytes, dtype=torch.uint8, device=device)
        self.base_ptr = self.buffer.data_ptr()
        descs = [KvdGroupDesc.from_group(g, layout.object_bytes, layout.chunk_size) for g in layout.groups]
        layer_ptrs = [[storages[s].data_ptr() + off for s, off in g.offsets] for g in layout.groups]
        self.handle = kernels.engine_create(device.index if device.index is not None else torch.cuda.current_device(),
                                            descs, layer_ptrs, layout.chunk_size, layout.object_bytes)
        self._gids = [g.gid for g in layout.groups]
        self.ring = StagingRing(ring_bytes)
        self.load_ring = StagingRing(load_ring_bytes, base=ring_bytes, shares=self.ring) if load_ring_bytes else self.ring
        self.rings = [self.ring] if self.load_ring is self.ring else [self.ring, self.load_ring]
        self.spec: StorageSpec = export_cuda_storage(self.buffer)
        try:
            self.fence: FenceWords | None = FenceWords(kernels, self.ring.max_live + 1)
        except (OSError, KernelError) as exc:
            log.warning("fence words unavailable (%s): staged stores wait for their gathers", exc)
            self.fence = None
        self.fence_active = False  # the daemon polls the words (RegisterReply.fence)
        self.landed_active = False  # its DMA stream writes them too (RegisterReply.landed)

    def flat_ids(self, block_ids: Sequence[Sequence[int]]) -> array.array:
        """int32 block ids, ``block_ids[gid]`` for each layer group in order."""
        if len(self._gids) == 1:
            return array.array("i", block_ids[self._gids[0]])
        out = array.array("i")
        for gid in self._gids:
            ids = block_ids[gid]
            if isinstance(ids, list):
                out.fromlist(ids)  # a third of extend()'s time
            else:
                out.extend(ids)
        return out

    def gather(self, block_ids: Sequence[Sequence[int]], num_chunks: int, offset: int, stream,
               fence_seq: int | None = None) -> None:
        """Enqueue on ``stream`` (a ``torch.cuda.Stream``) the gather of ``num_chunks`` chunks
        into the ring at ``offset``, then (``fence_seq`` given) the write of ``fence_seq`` into
        its fence word, in one call (`Kernels.engine_gather`).

        Raises:
            KernelError: as `Kernels.engine_gather` (a gather enqueued before the error may
                still run; no word is written).
        """
        word = 0 if fence_seq is None else self.fence.word_ptr(fence_seq)
        self.kernels.engine_gather(self.handle, self.flat_ids(block_ids), num_chunks, self.base_ptr + offset,
                                   stream.cuda_stream, word, fence_seq or 0)

    def gather_pieces(self, block_ids: Sequence[Sequence[int]], regions: Sequence[StagingRegion],
                      piece_chunks: Sequence[int], stream) -> None:
        """Enqueue on ``stream`` the gather of several requests' chunks (``block_ids``: per KV-cache
        group, every piece's chunks in order) into their ``regions`` (`StagingRing.alloc_pieces`;
        piece q: ``piece_chunks[q]`` chunks), then the write of each region's number into its
        fence word, in one call (`Kernels.engine_gather_pieces`).

        Raises:
            KernelError: as `Kernels.engine_gather_pieces` (no word is written then).
        """
        base, fence = self.base_ptr, self.fence
        self.kernels.engine_gather_pieces(self.handle, self.flat_ids(block_ids),
                                          array.array("Q", [base + r.offset for r in regions]),
                                          array.array("q", piece_chunks),
                                          array.array("Q", [fence.word_ptr(r.seq) for r in regions]),
                                          array.array("Q", [r.seq for r in regions]), stream.cuda_stream)

    def scatter(self, block_ids: Sequence[Sequence[int]], num_chunks: int, retrieved: int, offset: int,
                skip_tokens: int, stream, done_seq: int | None = None) -> None:
        """Enqueue on ``stream`` the scatter of the leading ``retrieved`` chunks at ``offset``
        into the blocks, leaving the first ``skip_tokens`` tokens' blocks untouched; then
        (``done_seq`` given: the region's number, fence words present) the write of
        ``done_seq`` into its fence word, in one call: ``fence.holds(done_seq)`` tells when the
        scatter ran. The daemon polls only a store's word for a store's number, so this write
        never releases a copy."""
        word = 0 if done_seq is None else self.fence.word_ptr(done_seq)
        self.kernels.engine_scatter(self.handle, self.flat_ids(block_ids), num_chunks, retrieved,
                                    self.base_ptr + offset, skip_tokens, stream.cuda_stream, word, done_seq or 0)

    def scatter_gated(self, block_ids: Sequence[Sequence[int]], num_chunks: int, offset: int, skip_tokens: int,
                      stream, seq: int) -> None:
        """Enqueue on ``stream`` region ``seq``'s scatter (``num_chunks`` chunks at ``offset``)
        before the daemon copied anything into it: behind a wait for the region's fence word to
        carry `LANDED_BIT` (the daemon's DMA stream writes it after its copies, or the CPU:
        `FenceWords.open_gate`), each chunk written only if the word's count covers it; then
        `GATE_DONE_BIT` added to the word (the region frees once `FenceWords.holds`; the count
        stays readable). ``stream`` waits until the word is written.

        Raises:
            KernelError: as `Kernels.engine_scatter_gated` (call `FenceWords.open_gate` then).
        """
        word = self.fence.word_ptr(seq)
        self.kernels.engine_scatter_gated(self.handle, self.flat_ids(block_ids), num_chunks, self.base_ptr + offset,
                                          skip_tokens, word, stream.cuda_stream, word, seq)

    def open_gates(self) -> None:
        """Open the gate of every live region's gated scatter (`FenceWords.open_gate`): their
        daemon will write no more landed words (the registration is going)."""
        if self.fence is None:
            return
        with self.ring._lock:
            seqs = [r.seq for ring in self.rings for r in ring.live if r.gated]
        for seq in seqs:
            self.fence.open_gate(seq)

    def close(self) -> None:
        """Free the library's state (the ring is freed with this object; no transfer may use it)."""
        if self.handle:
            self.kernels.engine_destroy(self.handle)
            self.handle = 0
        if self.fence is not None:
            self.fence.close()
            self.fence = None
