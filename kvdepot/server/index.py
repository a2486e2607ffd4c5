"""Chunk index: chunk key -> cached object, with prefix-aware LRU eviction and pins.

Entries form prefix chains (``entry.parent`` is the key of the chunk before it). A chunk is
useless once its parent is gone, so only *leaves* (entries with no cached child) are
evicted, least recently used first. Touching a hit chain walks it tail-first, so every
parent is more recent than its children and the LRU end holds chain tails.

Entry states (checked transitions)::

    WRITING --commit--> READY --(readers += 1 / -= 1)--> READY
       |                  |
       +---abort----------+---evict / flush---> (gone; freed now, or when readers reach 0)

Only READY entries are visible to lookups and retrieves (fail closed: a chunk is never
answered before its copy completed). A WRITING entry may already have children (a store of
the next chunks arrived while it was being written); they are served only once it is READY,
and dropped if it aborts. An entry with readers (a retrieve in progress or a
lookup pin) or in WRITING is never evicted; flushing it hides it at once and frees its
memory when the last reader leaves.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable

import msgspec

from kvdepot.server.quotas import TenantLedger


class EntryState(enum.Enum):
    WRITING = 1  # memory allocated, copy in progress, invisible
    READY = 2  # bytes complete; visible
    DOOMED = 3  # removed from the index while in use; freed when readers reach 0


class Entry(msgspec.Struct, gc=False, eq=False):
    """One cached chunk object in L1.

    Never tracked by Python's garbage collector (``gc=False``: it refers to no container, so
    it can be in no reference cycle): a daemon holds one per chunk, and a full collection
    walks every tracked object, stalling the event loop (a million tracked entries: about a
    quarter of a second on the dev VM, every time the survivors grew by a quarter)."""

    key: bytes  # chunk key (prefix-chained hash)
    parent: bytes  # key of the previous chunk; b"" for chunk 0
    offset: int  # byte offset of the object in the L1 arena
    size_bytes: int  # object bytes
    model: str  # model label (metrics, flush by model)
    cache_salt: str  # tenant salt (flush by salt)
    fingerprint: str = ""  # layout fingerprint of the registration that stored it (lower tiers check it)
    state: EntryState = EntryState.WRITING
    readers: int = 0  # in-flight retrieves + lookup pins; > 0 blocks eviction
    children: int = 0  # cached entries whose parent is this one; > 0 blocks eviction
    linked: bool = False  # counted in its parent's ``children`` (the parent was in L1 when it came)


class ChunkIndex:
    """Chunk key -> `Entry`, LRU-ordered, with prefix-aware eviction.

    Args:
        free_fn: called as ``free_fn(entry, evicted)`` when an entry's memory may be reused:
            ``evicted`` True when LRU eviction removed it (a lower tier may keep it), False when
            flushed, aborted, or doomed and released.
        tenants: bytes per tenant (``cache_salt``) of the entries in the index, and their quotas
            (`kvdepot.server.quotas`); kept up to date here.
        on_leave: called as ``on_leave(model, key)`` when an entry leaves the index (evicted,
            flushed, aborted); e.g. `kvdepot.server.events.ChunkEvents.left`.
    """

    def __init__(self, free_fn: Callable[[Entry, bool], None], tenants: TenantLedger | None = None,
                 on_leave: Callable[[str, bytes], None] | None = None) -> None:
        self._entries: OrderedDict[bytes, Entry] = OrderedDict()  # LRU first, MRU last
        self._free = free_fn
        self.evictions = 0
        self.tenants = TenantLedger({}) if tenants is None else tenants
        self._on_leave = on_leave or (lambda model, key: None)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> Entry | None:
        return self._entries.get(key)

    def ready(self, key: bytes) -> Entry | None:
        e = self._entries.get(key)
        return e if e is not None and e.state is EntryState.READY else None

    def entries(self) -> Iterable[Entry]:
        return self._entries.values()

    # ---------------------------------------------------------------- lifecycle

    def begin_write(self, key: bytes, parent: bytes, offset: int, size_bytes: int, model: str, cache_salt: str,
                    fingerprint: str = "") -> Entry:
        """Add a WRITING entry. Its parent (if any) is in this index or in a lower tier: only a
        parent in this index counts the entry as a child (and is kept while it is cached)."""
        assert key not in self._entries, "begin_write on a present key"
        e = Entry(key, parent, offset, size_bytes, model, cache_salt, fingerprint)
        if parent:
            p = self._entries.get(parent)
            if p is not None:
                p.children += 1
                e.linked = True
        self._entries[key] = e
        self.tenants.add(cache_salt, key, e, size_bytes)
        return e

    def commit(self, e: Entry) -> None:
        """WRITING -> READY: the object's bytes are complete and may be served."""
        assert e.state is EntryState.WRITING, f"commit from {e.state}"
        e.state = EntryState.READY
        if self._entries.get(e.key) is not e:  # flushed while writing
            e.state = EntryState.DOOMED
            self._maybe_free(e)

    def abort(self, e: Entry) -> None:
        """Drop a WRITING entry whose copy failed and free its memory. Abort a request's
        entries tail first (children before parents). Entries another store chained onto it
        while it was being written are dropped too (`drop_where`): they would never be served
        without it, and could not be evicted either."""
        assert e.state is EntryState.WRITING, f"abort from {e.state}"
        if e.children:
            key = e.key
            self.drop_where(lambda x: x.parent == key)
        self._remove(e)
        e.state = None
        self._free(e, False)

    def retag(self, e: Entry, model: str, cache_salt: str, fingerprint: str) -> None:
        """Name a WRITING entry's model, tenant and fingerprint (an object whose header says
        them only once read: L3), its bytes then counted to that tenant."""
        assert e.state is EntryState.WRITING, f"retag from {e.state}"
        if self._entries.get(e.key) is e:
            self.tenants.remove(e.cache_salt, e.key, e.size_bytes)
            self.tenants.add(cache_salt, e.key, e, e.size_bytes)
        e.model, e.cache_salt, e.fingerprint = model, cache_salt, fingerprint

    def acquire(self, e: Entry) -> None:
        """Add a reader (blocks eviction). Only READY entries may be read."""
        assert e.state is EntryState.READY, f"acquire from {e.state}"
        e.readers += 1

    def release(self, e: Entry) -> None:
        """Drop a reader; frees a DOOMED entry when its last reader leaves."""
        assert e.readers > 0, "release without acquire"
        e.readers -= 1
        self._maybe_free(e)

    def touch_chain(self, keys: list[bytes]) -> None:
        """Mark a hit chain most recently used, tail first so parents end up newer."""
        entries, tenants = self._entries, self.tenants
        for k in reversed(keys):
            e = entries.get(k)
            if e is not None:
                entries.move_to_end(k)
                tenants.touch(e.cache_salt, k)

    # ---------------------------------------------------------------- removal

    def _remove(self, e: Entry, evicted: bool = False) -> None:
        if self._entries.get(e.key) is not e:
            return
        del self._entries[e.key]
        self.tenants.remove(e.cache_salt, e.key, e.size_bytes)
        self._on_leave(e.model, e.key)
        if e.linked:
            e.linked = False
            p = self._entries.get(e.parent)
            if p is not None:
                p.children -= 1
        if e.state is EntryState.WRITING:
            # memory is freed by commit/abort of the writer; mark it so commit does not publish it
            return
        if e.readers:
            e.state = EntryState.DOOMED  # freed when its last reader leaves (`_maybe_free`)
        else:
            e.state = None  # freed; no further transitions
            self._free(e, evicted)

    def _maybe_free(self, e: Entry, evicted: bool = False) -> None:
        if e.state is EntryState.DOOMED and e.readers == 0:
            e.state = None  # freed; no further transitions
            self._free(e, evicted)

    def evict_one(self) -> Entry | None:
        """Evict the least recently used evictable leaf; None if nothing is evictable."""
        return self._evict_first(self._entries.values())

    def evict_own(self, salt: str) -> Entry | None:
        """Evict tenant ``salt``'s least recently used evictable leaf (its quota is full);
        None if none of its entries is evictable."""
        victim = self._evict_first(self.tenants.oldest(salt))
        if victim is not None:
            self.tenants.evicted(salt)
        return victim

    def _evict_first(self, candidates) -> Entry | None:
        """Evict the first READY leaf nobody reads among ``candidates`` (LRU order)."""
        ready = EntryState.READY
        for e in candidates:
            if e.state is ready and e.readers == 0 and e.children == 0:
                break
        else:
            return None
        self._remove(e, evicted=True)  # (after the loop: removing changes what it iterated)
        self.evictions += 1
        return e

    def drop_where(self, pred: Callable[[Entry], bool]) -> tuple[int, int]:
        """Remove every entry matching ``pred`` (flush), and every cached descendant of one: a
        chunk is useless without its prefix, and an entry that outlived its parent would later
        decrement the ``children`` of a re-stored entry of the parent's key (which never
        counted it), leaving that entry unevictable. Returns (objects, bytes) dropped."""
        doomed = {e.key for e in self._entries.values() if pred(e)}
        grew = bool(doomed)
        while grew:
            n = len(doomed)
            doomed.update(e.key for e in self._entries.values() if e.parent in doomed)
            grew = len(doomed) > n
        victims = [e for e in self._entries.values() if e.key in doomed]
        n = b = 0
        for e in victims:
            self._remove(e)
            n += 1
            b += e.size_bytes
        return n, b
