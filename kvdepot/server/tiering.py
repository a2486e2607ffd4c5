"""Tiers behind the chunk index: L1 allocation and eviction, the L2 disk tier (spill on
eviction, promotion on a hit), the walk of a chain across tiers, flush and the tiers' part
of describe and /metrics: `Tiers`, on the daemon's event loop.

Objects are written through to L2 as they are committed (`committed`; held in L1 as
readers until written, at most ``l2_queue_bytes`` of writes in flight, beyond which a write is
dropped and counted), so a restart finds the hot cache on disk; what was dropped is written
ahead of its eviction while the disk keeps up (`spill_ahead`), when evicted (write-behind: its
L1 extent stays allocated until written) unless L2 already holds its key, and by a clean stop
(`drain_to_l2`). They move up by promotion: a retrieve
(or a lookup that pins its hits, as vLLM's scheduler does, ahead of the retrieve) that finds
chunks in L2 but not in L1 reads them into new L1 entries, WRITING until the read is verified,
and the retrieve goes on once they are READY. A chunk is served only from L1, so every
byte an engine receives comes from a verified read. Lookups walk a chain from chunk 0 through
either tier: a chunk counts when L1 or L2 holds it READY.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence

from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.server.disk import DiskEntry, DiskTier
from kvdepot.server.index import ChunkIndex, Entry, EntryState
from kvdepot.server.objfile import ObjectMeta, padded
from kvdepot.server.quotas import TenantLedger, scaled
from kvdepot.server.remote import RemoteTier, redact

log = logging.getLogger("kvdepot.daemon")

# L1 bytes kept free or already in L2 (so evictable at once) while the disk keeps up
_CLEAN_FRACTION = 0.25
_BEHIND_MAX = 1 << 16  # committed entries at most waiting to be written through to L2


class Tiers:
    """L1 (``pool`` and the chunk ``index`` over it), L2 and L3 (see the module docstring).

    Args:
        config: the daemon's `kvdepot.server.daemon.DaemonConfig` (its ``l2_*`` / ``l3_*``).
        pool: L1's pinned host memory.
        metrics: the daemon's `kvdepot.server.metrics.Metrics` (tier gauges, read at scrape).
        front: the `kvdepot.server.front.Front` that answers a flush waiting for L3.
        events: the `kvdepot.server.events.ChunkEvents` told of chunks entering and leaving.

    Attributes:
        index: L1's `ChunkIndex` (made here: its evictions spill to L2, `free_entry`).
        l2, l3: the lower tiers, or None.
        tier_names: ``("l1", ...)`` of the tiers configured; ``hits``: chunks a lookup found
            in each (`kvdepot.server.lookups`).
    """

    def __init__(self, config, pool, metrics, front, events) -> None:
        cfg = config
        self.pool = pool
        self.metrics = metrics
        self.front = front
        self.events = events
        quotas = dict(getattr(cfg, "tenant_quotas", None) or {})
        self.index = ChunkIndex(self.free_entry, TenantLedger(quotas), events.left)
        self._loop = None  # the event loop, from `open`
        self.l2: DiskTier | None = None
        if cfg.l2_path:
            queue = cfg.l2_queue_bytes or min(2 << 30, max(self.pool.capacity_bytes // 8, 1))
            self.l2 = DiskTier(cfg.l2_path, cfg.l2_capacity_bytes, queue, cfg.l2_io_threads, cfg.l2_direct_io,
                               scaled(quotas, cfg.l2_capacity_bytes, max(1, self.pool.capacity_bytes)), events.left)
        self.l3: RemoteTier | None = None
        if cfg.l3_url:
            queue = cfg.l3_queue_bytes or min(1 << 30, max(self.pool.capacity_bytes // 8, 1))
            self.l3 = RemoteTier(cfg.l3_url, cfg.l3_prefix, cfg.l3_ttl_s, queue, cfg.l3_timeout_s, cfg.l3_cluster)
        self.tier_names = ("l1",) + (("l2",) if self.l2 is not None else ()) + (("l3",) if self.l3 is not None else ())
        self.hits = dict.fromkeys(self.tier_names, 0)
        self._promoting: dict[bytes, asyncio.Future] = {}  # key -> resolves True once READY in L1
        self._spill_pending = False
        self._l2_behind: collections.deque[Entry] = collections.deque()  # committed, waiting to be written through
        self._bind_metrics()

    def _bind_metrics(self) -> None:
        """Tier gauges and lower tiers' counters are read at scrape time (nothing to update per
        request)."""
        mt = self.metrics
        self._l1_evictions = mt.evictions.labels("l1")  # bumped by every eviction from L1 (`alloc`)
        mt.tier_capacity_bytes.labels("l1").set(self.pool.capacity_bytes)
        mt.tier_used_bytes.labels("l1").set_function(lambda: self.pool.used_bytes)
        mt.tier_objects.labels("l1").set_function(lambda: len(self.index))
        for tier in self.tier_names:
            mt.tier_hits.set_function((tier,), lambda tier=tier: self.hits[tier])
        l2 = self.l2
        if l2 is not None:
            mt.tier_capacity_bytes.labels("l2").set(l2.capacity_bytes)
            mt.tier_used_bytes.labels("l2").set_function(lambda: l2.used_bytes)
            mt.tier_objects.labels("l2").set_function(lambda: len(l2))
        for tier, ledger in (("l1", self.index.tenants),) + ((("l2", l2.tenants),) if l2 is not None else ()):
            for label in ledger.labels():  # the configured tenants, (none) and other: a fixed set
                mt.tenant_used_bytes.labels(tier, label).set_function(lambda g=ledger, k=label: g.label_used(k))
                mt.tenant_quota_bytes.labels(tier, label).set(ledger.label_quota(label))
                mt.tenant_quota_evictions.set_function((tier, label), lambda g=ledger, k=label: g.label_evictions(k))
        for tier in (t for t in (l2, self.l3) if t is not None):
            mt.tier_queue_depth.labels(tier.name).set_function(lambda tier=tier: tier.queued_writes)
            c = tier.counters
            for fam, attr in ((mt.tier_read_bytes, "read_bytes"), (mt.tier_written_bytes, "written_bytes"),
                              (mt.tier_dropped_writes, "dropped_writes"), (mt.tier_errors, "errors"),
                              (mt.corrupt_objects, "corrupt")) + (((mt.evictions, "evictions"),) if tier is l2 else ()):
                fam.set_function((tier.name,), lambda c=c, attr=attr: getattr(c, attr))

    async def open(self) -> None:
        """Open L2 (lock, scan) off the loop, before anything is served.

        Raises:
            OSError: the L2 directory is unusable or used by another daemon.
        """
        loop = self._loop = asyncio.get_running_loop()
        if self.l2 is not None:
            await loop.run_in_executor(None, self.l2.open)
            self.l2.attach(loop)
        if self.l3 is not None:
            self.l3.open(loop)
            log.info("L3 at %s (prefix %r, TTL %.0f s)", redact(self.l3.url), self.l3.prefix.decode(), self.l3.ttl_s)

    def close(self) -> None:
        if self.l2 is not None:
            self.l2.close()
        if self.l3 is not None:
            self.l3.close()

    # ------------------------------------------------------------------ L1 memory

    def alloc(self, size_bytes: int, cache_salt: str | None) -> int | None:
        """An L1 extent for an object of tenant ``cache_salt``, evicting least recently used
        leaves (to L2 where there is one) until it fits: first the tenant's own while
        ``size_bytes`` more would take it over its quota (`kvdepot.server.quotas`), then
        anyone's (``cache_salt`` None: not known yet, no quota applies). None when nothing more
        is evictable."""
        pool = self.pool
        allocator = pool.allocator
        if size_bytes > allocator.segment_bytes:
            return None  # can never fit: evicting would only empty the cache for nothing
        if cache_salt is not None and not self._within_quota(cache_salt, size_bytes):
            return None
        while True:
            off = allocator.alloc(size_bytes, pool.usable_bytes)  # (`HostPool.alloc`)
            if off is not None:
                return off
            if self.index.evict_one() is None:
                return None
            self._l1_evictions.value += 1

    def _within_quota(self, cache_salt: str, size_bytes: int) -> bool:
        """Evict tenant ``cache_salt``'s own least recently used leaves while ``size_bytes`` more
        would take it over its L1 quota; False if they cannot make that room."""
        tenants = self.index.tenants
        if not tenants.over(cache_salt, size_bytes):
            return True
        if size_bytes > tenants.limit(cache_salt):
            return False
        while tenants.over(cache_salt, size_bytes):
            if self.index.evict_own(cache_salt) is None:
                return False
            self._l1_evictions.value += 1
        return True

    def free_entry(self, e: Entry, evicted: bool) -> None:
        """The index no longer needs ``e``'s extent: an evicted entry is written to L2 first
        (the extent is freed once written), anything else is freed now."""
        l2 = self.l2
        if evicted and l2 is not None and l2.write(
                e.key, e.parent, e.model, e.cache_salt, e.fingerprint,
                self.pool.view(e.offset, padded(e.size_bytes)), e.size_bytes, lambda: self.pool.free(e.offset)):
            return
        self.pool.free(e.offset)

    def spill_ahead(self, max_scan: int = 512) -> None:
        """Write least recently used L1 entries to L2 ahead of their eviction, while they stay
        in L1 and readable (held as a reader until written), until L1's free bytes plus its
        bytes already in L2 reach `_CLEAN_FRACTION` of L1 (at least the write queue's bound),
        with at most the queue's bound of writes in flight: a store that needs room then evicts
        entries L2 already holds, which frees memory at once, instead of queueing (or dropping)
        writes of dirty ones. Runs after stores and promotions, whenever one of its writes
        ends (so it keeps going while the disk keeps up), and from the sweeper."""
        l2 = self.l2
        if l2 is None:
            return
        pool = self.pool
        target = max(l2.queue_limit_bytes, int(pool.capacity_bytes * _CLEAN_FRACTION))
        need = target - (pool.usable_bytes - pool.used_bytes)
        for i, e in enumerate(self.index.entries()):  # least recently used first
            if need <= 0 or i >= max_scan:
                return
            if e.state is not EntryState.READY:
                continue
            if l2.get(e.key) is None:
                if l2.queued_bytes + padded(e.size_bytes) > l2.queue_limit_bytes:
                    return
                self.index.acquire(e)
                if not l2.write(e.key, e.parent, e.model, e.cache_salt, e.fingerprint,
                                pool.view(e.offset, padded(e.size_bytes)), e.size_bytes,
                                lambda e=e: self._spilled_ahead(e)):
                    self.index.release(e)
                    return
            need -= padded(e.size_bytes)

    def committed(self, entries: Sequence[Entry]) -> None:
        """A store committed ``entries`` (READY in L1, in commit order): write them through to
        L2 and L3."""
        stored = self.events.stored
        for e in entries:
            stored(e.model, e.key)
        if self.l2 is not None:
            self._write_through_l2(entries)
        if self.l3 is not None:
            self._write_through_l3(entries)

    def _write_through_l2(self, entries: Sequence[Entry]) -> None:
        """Write just-committed ``entries`` to L2, in commit order (parents first), as fast as
        the write queue takes them (`_catch_up_l2`)."""
        behind = self._l2_behind
        behind.extend(entries)
        while len(behind) > _BEHIND_MAX:  # a disk that stopped: give the oldest up (counted)
            behind.popleft()
            self.l2.counters.dropped_writes += 1
        self._catch_up_l2()

    def _catch_up_l2(self) -> None:
        """Start the writes of committed entries waiting for queue room (held in L1 as readers
        until written; ones evicted, flushed or in L2 meanwhile are skipped: an evicted one was
        written when it left L1)."""
        l2, pool, index, behind = self.l2, self.pool, self.index, self._l2_behind
        while behind:
            e = behind[0]
            if index.get(e.key) is not e or e.state is not EntryState.READY or l2.get(e.key) is not None:
                behind.popleft()
                continue
            if l2.queued_bytes + padded(e.size_bytes) > l2.queue_limit_bytes:
                return  # resumed when a write ends (`_spill_continue`)
            behind.popleft()
            index.acquire(e)
            if not l2.write(e.key, e.parent, e.model, e.cache_salt, e.fingerprint,
                            pool.view(e.offset, padded(e.size_bytes)), e.size_bytes,
                            lambda e=e: self._spilled_ahead(e)):
                index.release(e)  # no room on disk (counted)

    async def drain_to_l2(self, drain_s: float) -> None:
        """At a clean stop: write every READY L1 entry L2 does not hold, most recently used
        first, as fast as the queue takes them, for at most ``drain_s`` seconds; then wait
        for the writes in flight (within the same time)."""
        l2 = self.l2
        if l2 is None or drain_s <= 0:
            return
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + drain_s
        todo = [e for e in self.index.entries() if e.state is EntryState.READY and l2.get(e.key) is None]
        total = len(todo)
        while (todo or l2.queued_writes) and loop.time() < deadline:
            while todo:
                e = todo[-1]
                if e.state is not EntryState.READY or l2.get(e.key) is not None:
                    todo.pop()  # flushed, or written meanwhile
                    continue
                if l2.queued_bytes + padded(e.size_bytes) > l2.queue_limit_bytes:
                    break
                todo.pop()
                self.index.acquire(e)
                if not l2.write(e.key, e.parent, e.model, e.cache_salt, e.fingerprint,
                                self.pool.view(e.offset, padded(e.size_bytes)), e.size_bytes,
                                lambda e=e: self.index.release(e)):
                    self.index.release(e)
            await asyncio.sleep(0.005)
        if total or todo:
            log.info("stop: wrote %d of %d L1 chunks not yet in L2 in %.1f s%s", total - len(todo), total,
                     loop.time() - t0, f" ({len(todo)} not written: --shutdown-drain-s)" if todo else "")

    def _spilled_ahead(self, e: Entry) -> None:
        self.index.release(e)
        if not self._spill_pending:  # one continuation per loop turn, however many writes ended
            self._spill_pending = True
            self._loop.call_soon(self._spill_continue)

    def _spill_continue(self) -> None:
        self._spill_pending = False
        self._catch_up_l2()
        self.spill_ahead()

    # ------------------------------------------------------------------ lookups and pins

    def find(self, key: bytes, size_bytes: int | None = None) -> Entry | DiskEntry | None:
        """The READY object of ``key`` in the fastest tier holding it (of ``size_bytes``, if given)."""
        e = self.index.ready(key)
        if e is None and self.l2 is not None:
            e = self.l2.ready(key)
        if e is not None and size_bytes is not None and e.size_bytes != size_bytes:
            return None
        return e

    def acquire(self, e: Entry | DiskEntry) -> None:
        (self.index if isinstance(e, Entry) else self.l2).acquire(e)

    def release(self, e: Entry | DiskEntry) -> None:
        (self.index if isinstance(e, Entry) else self.l2).release(e)

    def walk(self, chain: Sequence[bytes], l3_sizes: dict[bytes, int] | None = None) -> list:
        """The leading run of ``chain`` that some tier holds: L1 `Entry` / L2 `DiskEntry` objects,
        and ``(key, payload bytes)`` for chunks only L3 holds (``l3_sizes``, from one round trip)."""
        got = []
        for k in chain:
            e = self.find(k)
            if e is None:
                size = l3_sizes.get(k, 0) if l3_sizes else 0
                if not size:
                    break
                e = (k, size)
            got.append(e)
        return got

    # ------------------------------------------------------------------ promotion (L2 -> L1)

    def promote(self, d: DiskEntry) -> asyncio.Future:
        """Read ``d`` into a new L1 entry; the future resolves True once it is READY in L1,
        False if it could not be (no L1 room, a bad file: nothing is served from it)."""
        fut = self._promoting.get(d.key)
        if fut is not None:
            return fut
        fut = self._loop.create_future()
        if self.index.get(d.key) is not None:  # READY, or being written by a store
            fut.set_result(self.index.ready(d.key) is not None)
            return fut
        l2 = self.l2
        l2.acquire(d)  # an L1 eviction below may spill into L2 and evict there: not this one
        try:
            off = self.alloc(d.size_bytes, d.cache_salt)
            if off is None:
                fut.set_result(False)
                return fut
            e = self.index.begin_write(d.key, d.parent, off, d.size_bytes, d.model, d.cache_salt, d.fingerprint)
            self._promoting[d.key] = fut

            def done(err: BaseException | None) -> None:
                del self._promoting[d.key]
                if err is None:
                    self.index.commit(e)
                    self.spill_ahead()
                else:
                    self.index.abort(e)
                fut.set_result(err is None)

            l2.read(d, self.pool.view(off, padded(d.size_bytes)), done)
        finally:
            l2.release(d)
        return fut

    def promote_l3(self, key: bytes, parent: bytes, size_bytes: int, model: str) -> asyncio.Future:
        """Fetch ``key``'s object from L3 into a new L1 entry (as `promote`); the entry takes
        its model, salt and fingerprint from the verified header."""
        fut = self._promoting.get(key)
        if fut is not None:
            return fut
        fut = self._loop.create_future()
        if self.index.get(key) is not None:
            fut.set_result(self.index.ready(key) is not None)
            return fut
        off = self.alloc(size_bytes, None)  # (its tenant is known from the header: `ChunkIndex.retag`)
        if off is None:
            fut.set_result(False)
            return fut
        e = self.index.begin_write(key, parent, off, size_bytes, model, "")
        self._promoting[key] = fut

        def done(meta: ObjectMeta | None, err: BaseException | None) -> None:
            del self._promoting[key]
            if err is None:
                self.index.retag(e, meta.model, meta.cache_salt, meta.fingerprint)
                self._within_quota(e.cache_salt, 0)  # its tenant's older chunks go (not it: still WRITING)
                self.index.commit(e)
                self.events.stored(e.model, e.key)
                self.spill_ahead()
            else:
                self.index.abort(e)
            fut.set_result(err is None)

        self.l3.fetch(key, size_bytes, self.pool.view(off, size_bytes), done)
        return fut

    def _write_through_l3(self, entries: Sequence[Entry]) -> None:
        """Send newly stored entries to L3 (each held in L1 until its value is built and sent)."""
        l3 = self.l3
        for e in entries:
            if e.state is not EntryState.READY:
                continue
            self.index.acquire(e)
            meta = ObjectMeta(e.key, e.parent, e.model, e.cache_salt, e.fingerprint, e.size_bytes, b"")
            if not l3.write(meta, self.pool.view(e.offset, e.size_bytes), lambda e=e: self.index.release(e)):
                self.index.release(e)

    def promotions(self, keys: Sequence[bytes], size_bytes: int) -> list[asyncio.Future]:
        """Promotions the leading chunks of ``keys`` wait for (started here where needed);
        empty when they are all in L1 (or missing)."""
        if self.l2 is None and self.l3 is None:
            return []
        waits = []
        for k in keys:
            if self.index.ready(k) is not None:
                continue
            fut = self._promoting.get(k)  # an L2 read or L3 fetch in progress
            if fut is None:
                d = self.l2.ready(k) if self.l2 is not None else None
                if d is None or d.size_bytes != size_bytes:
                    break
                fut = self.promote(d)
            waits.append(fut)
        return waits

    # ------------------------------------------------------------------ flush, describe

    def on_flush(self, identity: bytes, req: m.Flush) -> m.Msg | None:
        """`m.Flush`: drop the matching objects of the tier asked (all: every tier); L3 only
        whole, answered once it did."""
        if req.tier not in ("", *self.tier_names):
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"unknown tier {req.tier!r}; this daemon's tiers: {', '.join(self.tier_names)}")

        def match(e: Entry | DiskEntry) -> bool:
            return ((not req.model or e.model == req.model)
                    and (req.cache_salt is None or e.cache_salt == req.cache_salt))

        selective = bool(req.model) or req.cache_salt is not None
        if req.tier == "l3" and selective:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "L3 keys do not name their model or salt: flush --tier l3 "
                                                           "drops every object under the L3 prefix, for every daemon")
        n = b = 0
        if not req.tier and req.cache_salt is None:  # every chunk (of the model): one event, not one per key
            self.events.cleared(req.model)
        if req.tier in ("", "l1"):
            n, b = self.index.drop_where(match)
        if self.l2 is not None and req.tier in ("", "l2"):
            n2, b2 = self.l2.drop_where(match)
            n, b = n + n2, b + b2
        log.info("flushed %d objects (%d bytes)%s", n, b, f" from {req.tier}" if req.tier else "")
        if self.l3 is None or req.tier not in ("", "l3") or selective:  # (L3 only when flushed whole)
            return m.FlushReply(rid=req.rid, objects=n, bytes=b)

        def done(count: int | None) -> None:
            if count is None:
                self.front.reply_error(identity, req.rid, RequestError(
                    ErrorCode.TIER_UNAVAILABLE, f"L3 at {redact(self.l3.url)} did not flush (see the daemon's log); "
                                                f"L1 and L2 dropped {n} objects"))
                return
            log.info("flushed %d objects from l3", count)
            self.front.reply(identity, m.FlushReply(rid=req.rid, objects=n + count, bytes=b))

        self.l3.flush(done)
        return None

    def tenant_infos(self) -> list[m.TenantInfo]:
        """Per tier, each tenant's bytes and quota; empty without quotas."""
        if not self.index.tenants.quotas:
            return []
        ledgers = (("l1", self.index.tenants),) + ((("l2", self.l2.tenants),) if self.l2 is not None else ())
        return [m.TenantInfo(tier, label, used, quota, ev) for tier, ledger in ledgers
                for label, (used, quota, ev) in ledger.by_label().items()]

    def infos(self) -> list[m.TierInfo]:
        out = [m.TierInfo("l1", self.pool.capacity_bytes, self.pool.used_bytes, len(self.index),
                          hit_chunks=self.hits["l1"], evictions=self.index.evictions)]
        l2 = self.l2
        if l2 is not None:
            c = l2.counters
            out.append(m.TierInfo(
                "l2", l2.capacity_bytes, l2.used_bytes, len(l2), hit_chunks=self.hits["l2"],
                evictions=c.evictions, read_bytes=c.read_bytes, written_bytes=c.written_bytes,
                queue_depth=l2.queued_writes, dropped_writes=c.dropped_writes, errors=c.errors,
                corrupt_objects=c.corrupt, detail=f"{l2.path} ({'O_DIRECT' if l2.direct_io else 'buffered'} I/O)"))
        l3 = self.l3
        if l3 is not None:  # its use and capacity are the server's (INFO memory there)
            c = l3.counters
            out.append(m.TierInfo(
                "l3", 0, 0, 0, hit_chunks=self.hits["l3"], read_bytes=c.read_bytes, written_bytes=c.written_bytes,
                queue_depth=l3.queued_writes, dropped_writes=c.dropped_writes, errors=c.errors,
                corrupt_objects=c.corrupt,
                detail=f"{redact(l3.url)}{' (cluster)' if l3.cluster else ''} prefix {l3.prefix.decode()!r}: {l3.state}"))
        return out
