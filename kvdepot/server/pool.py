"""L1 host memory pool: one arena of ``capacity_bytes`` and an extent allocator over it.

Objects of one model all have one size, so first-fit over an address-ordered free list with
coalescing keeps fragmentation near zero; mixed sizes (several models) still coalesce back
into large extents as objects are freed. Every extent is aligned to ``ALIGN_BYTES`` (page
size: 16-byte vector copies, and O_DIRECT for a disk tier).

Capacity exhaustion is not an error: `alloc` returns None and the caller evicts or skips.
"""

from __future__ import annotations

import bisect

import torch

ALIGN_BYTES = 4096


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class ExtentAllocator:
    """First-fit allocator of aligned byte extents in ``[0, capacity_bytes)``.

    Free extents are kept address-ordered (``_starts`` sorted, ``_sizes[start]``) and
    coalesced with both neighbours on free. Not thread-safe: the daemon's event loop owns it.
    """

    def __init__(self, capacity_bytes: int, align_bytes: int = ALIGN_BYTES) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.align_bytes = align_bytes
        self.capacity_bytes = capacity_bytes // align_bytes * align_bytes
        self._starts: list[int] = [0] if self.capacity_bytes else []
        self._sizes: dict[int, int] = {0: self.capacity_bytes} if self.capacity_bytes else {}
        self._allocated: dict[int, int] = {}  # start -> size (rounded)
        self.used_bytes = 0

    def alloc(self, size_bytes: int) -> int | None:
        """Offset of a new extent of at least ``size_bytes``, or None if no free extent fits."""
        if size_bytes <= 0:
            raise ValueError("size_bytes must be > 0")
        need = _round_up(size_bytes, self.align_bytes)
        for i, start in enumerate(self._starts):
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
        # coalesce with the next free extent
        if i < len(self._starts) and self._starts[i] == start + size:
            size += self._sizes.pop(self._starts[i])
            del self._starts[i]
        # coalesce with the previous free extent
        if i > 0:
            prev = self._starts[i - 1]
            if prev + self._sizes[prev] == start:
                self._sizes[prev] += size
                return
        self._starts.insert(i, start)
        self._sizes[start] = size

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    @property
    def num_free_extents(self) -> int:
        return len(self._starts)


class HostPool:
    """L1 tier: a host-memory arena (uint8 tensor) handed out as object buffers.

    The arena is allocated with ``torch.empty``, so pages are committed by the OS on first
    touch and start-up is instant for any capacity.
    """

    name = "l1"

    def __init__(self, capacity_bytes: int) -> None:
        self.allocator = ExtentAllocator(capacity_bytes)
        self.arena = torch.empty(self.allocator.capacity_bytes, dtype=torch.uint8)

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self.allocator.used_bytes

    def alloc(self, size_bytes: int) -> int | None:
        return self.allocator.alloc(size_bytes)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def buffer(self, offset: int, size_bytes: int) -> torch.Tensor:
        """uint8 view ``[size_bytes]`` of the arena at ``offset``."""
        return self.arena[offset : offset + size_bytes]
