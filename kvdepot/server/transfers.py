"""STORE and RETRIEVE: planning on the loop (index, L1 allocation, pins), the copies (CPU
engines on the thread pool, CUDA engines through `kvdepot.gpu.cuda_path`), and the reply from
their completion. A mixin of `kvdepot.server.daemon.Daemon` (registrations, index, pool,
metrics, executor)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvdepot import trace
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.server.index import Entry, EntryState

READY = EntryState.READY

if TYPE_CHECKING:
    from kvdepot.server.registration import Registration

log = logging.getLogger("kvdepot.daemon")
_TRACE = trace.POINTS  # None unless KVDEPOT_TRACE_FILE is set (see kvdepot/trace.py)
trace_point = trace.point
# values of kvdepot_store_skipped_chunks_total{reason}
STORE_SKIP_REASONS = ("parent_missing", "capacity")


class TransferHandlers:
    """The Store / Retrieve handlers (see the module docstring)."""

    def _on_store(self, identity: bytes, req: m.Store) -> m.Msg | None:
        """Plan the store on the loop (index, allocation), start the copies, and reply from
        their completion callback (no task per request). The hot path of small requests:
        measured per request by ``benchmarks/daemon_cpu.py`` (the handlers) and
        ``benchmarks/daemon_loop.py`` (the event loop around them)."""
        reg = self.registrations.get(req.registration) or self._registration(req.registration)
        lay = reg.layout
        keys = req.keys
        n = len(keys)
        self._check_block_ids(reg, req.block_ids, n)
        if reg.settled:
            _check_settled(reg, identity, req.rid)
        if req.deadline_ns:
            _check_deadline(req.deadline_ns, "store")
        runs = _store_runs(req, n) if req.chains else ((0, n, req.parent),)
        if reg.files:
            reg.check_memory()
        staged = req.staging_offset >= 0  # a CPU registration has no staging: refused in _staging_base
        staged_base = self._staging_base(reg, req.staging_offset, n) if staged else 0
        seq = self._staged_accept(reg, req.staging_seq) if staged and req.staging_seq else 0
        fence = None
        if req.fence:
            if not staged or reg.fence is None:
                raise RequestError(ErrorCode.INVALID_ARGUMENT, "fence given but the store is not staged, or the "
                                                               "registration has no fence words (RegisterReply.fence)")
            fence = (reg.fence.word_ptr(req.fence), req.fence)
        index = self.index
        ob = lay.object_bytes
        held: list[Entry] = []  # present entries kept from eviction while this store allocates
        new: list[tuple[int, Entry]] = []
        present = 0
        skipped_by: dict[str, int] = {}
        per_chain: list[m.ChainStored] | None = [] if req.chains else None
        full = False  # L1 had no room: nothing more of this request is stored
        # A parent (or a chunk of this request) still being written by an earlier store counts
        # as present: an engine whose stores are in flight sends a request's next chunks before
        # the previous ones are in L1. Their children stay invisible until every chunk before
        # them is READY (lookups walk the chain from chunk 0), and an aborted write drops its
        # descendants (`ChunkIndex.abort`), so nothing is ever served without its prefix.
        # A parent or chunk that only a lower tier (L2) holds counts as present too: the chunk is
        # not stored again, and its children are stored unlinked (`ChunkIndex.begin_write`).
        l2 = self.l2
        for start, end, parent in runs:
            reason = "capacity" if full else ""
            c_present = 0
            c_new = len(new)
            if parent and not reason:
                p = index.get(parent)
                if p is None:
                    if l2 is None or l2.ready(parent) is None:
                        reason = "parent_missing"
                elif p.state is READY:
                    index.acquire(p)
                    held.append(p)
            if not reason:
                for j in range(start, end):
                    key = keys[j]
                    e = index.get(key)
                    if e is None and l2 is not None:
                        d = l2.ready(key)
                        if d is not None and d.size_bytes == ob:
                            c_present += 1
                            parent = key
                            continue
                    if e is not None:
                        if e.size_bytes != ob:
                            reason = "parent_missing"  # another object format under this key: never chain onto it
                            break
                        if e.state is READY:  # (else WRITING: no reader may hold it; its children keep it)
                            index.acquire(e)
                            held.append(e)
                        c_present += 1
                    else:
                        off = self._alloc(ob)
                        if off is None:
                            reason = "capacity"
                            full = True
                            break
                        new.append((j, index.begin_write(key, parent, off, ob, reg.model, req.cache_salt,
                                                         lay.fingerprint)))
                    parent = key
            present += c_present
            c_stored = len(new) - c_new
            c_skipped = end - start - c_present - c_stored
            if c_skipped:
                skipped_by[reason] = skipped_by.get(reason, 0) + c_skipped
            if per_chain is not None:
                per_chain.append(m.ChainStored(c_stored, c_present, c_skipped))
        skipped = n - present - len(new)
        for reason, count in skipped_by.items():
            self.metrics.store_skipped_chunks.labels(reason).inc(count)
        # Every store is answered once its copies completed (`Store.reply_early` is ignored).
        reply = m.StoreReply(rid=req.rid, stored=len(new), present=present, skipped=skipped)
        if per_chain is not None:
            reply.chains = per_chain
        if not new:
            self._store_release(held, keys)
            return reply
        self._begin_transfer(reg, identity, req.rid)
        self._staged_begin(reg, seq)
        t0 = time.monotonic()
        token = self.watch("store", reg.id, identity, req.rid, len(new) * ob, True, t0)
        finish = functools.partial(self._store_done, identity, reg, req, reply, new, held, seq, token, t0)
        if _TRACE is not None:
            trace_point(req.rid, "enqueue")
        try:
            if reg.cuda_device is None:
                self._in_executor(finish, self._gather, reg, req.block_ids, new, req.deadline_ns)
            elif staged:
                base = self.pool.base_ptr
                self._cuda.path(reg.cuda_device).copy_staged(
                    True, [staged_base + j * ob for j, _ in new], [base + e.offset for _, e in new], ob, fence, finish,
                    _stored(reg, req, len(new)))
            else:
                base = self.pool.base_ptr
                self._cuda.path(reg.cuda_device).store(
                    reg.engine, req.block_ids, n, [j for j, _ in new], [base + e.offset for _, e in new], finish)
        except BaseException as exc:  # nothing was enqueued: roll back now
            finish(exc)
            return None
        if _TRACE is not None:
            trace_point(req.rid, "enqueued")
        return None

    def _store_done(self, identity: bytes, reg: Registration, req: m.Store, reply: m.StoreReply,
                    new: list[tuple[int, Entry]], held: list[Entry], seq: int, token: int, t0: float,
                    err: BaseException | None) -> None:
        """A store's copies ended (``err``: why not; on the loop): publish its chunks and reply,
        or drop them and answer the error."""
        if _TRACE is not None:
            trace_point(req.rid, "gpu_done")
        self._finish_transfer(reg, seq, identity, req.rid)
        stuck = self.unwatch(token)  # answered TIMEOUT by the watchdog: publish nothing, reply nothing
        if err is None and req.deadline_ns and time.monotonic_ns() > req.deadline_ns:
            # the engine may have reused the blocks while they were read: commit nothing
            err = RequestError(ErrorCode.DEADLINE, "the store's copies ended after its deadline; nothing was stored")
        try:
            index = self.index
            if err is not None or stuck:
                for _, e in reversed(new):
                    index.abort(e)
                if stuck:
                    return
                if not isinstance(err, RequestError):
                    err = RequestError(ErrorCode.ENGINE_MEMORY, f"store copy failed: {err}")
                self._reply_error(identity, req.rid, err)
                return
            for _, e in new:
                index.commit(e)
            if self.l2 is not None:
                self._write_through_l2([e for _, e in new])
            if self.l3 is not None:
                self._write_through([e for _, e in new])
            elapsed_s = time.monotonic() - t0
            self._reply(identity, reply)  # before the metrics: a lone store waits for this reply
            self._count_transfer(reg, "store", len(new), elapsed_s)
        finally:
            self._store_release(held, req.keys)

    def _store_release(self, held: list[Entry], keys: list[bytes]) -> None:
        index = self.index
        for e in held:
            index.release(e)
        index.touch_chain(keys)

    def _in_executor(self, finish: Callable[[BaseException | None], None], fn, *args) -> None:
        """Run ``fn(*args)`` in the copy threads; ``finish(error or None)`` runs on the loop."""
        stall_s = self._faults.copy_stall_s() if self._faults is not None else 0.0
        if stall_s:  # an injected stuck copy (soak tests only, kvdepot.server.faults)
            fn = functools.partial(_stalled, stall_s, fn)
        fut = self._loop.run_in_executor(self._executor, fn, *args)

        def done(f: asyncio.Future) -> None:
            finish(asyncio.CancelledError() if f.cancelled() else f.exception())

        fut.add_done_callback(done)

    def _gather(self, reg: Registration, block_ids, new: list[tuple[int, Entry]], deadline_ns: int = 0) -> None:
        """CPU engines, on a copy thread: read each new chunk out of the engine's blocks (not
        begun after ``deadline_ns``, `Store.deadline_ns`)."""
        if deadline_ns:
            _check_deadline(deadline_ns, "store")
        eng = reg.engine
        for j, e in new:
            eng.gather(self.pool.buffer(e.offset, e.size_bytes), self._chunk_block_ids(reg, block_ids, j))

    def _on_retrieve(self, identity: bytes, req: m.Retrieve, promote: bool = True) -> m.Msg | None:
        """``promote``: chunks only L2 holds are read into L1 first (the reply then comes once
        they are; `Tiering._promotions`)."""
        reg = self.registrations.get(req.registration) or self._registration(req.registration)
        lay = reg.layout
        keys = req.keys
        n = len(keys)
        self._check_block_ids(reg, req.block_ids, n)
        if reg.settled:
            _check_settled(reg, identity, req.rid)
        if req.deadline_ns:
            _check_deadline(req.deadline_ns, "retrieve")
        if reg.files:
            reg.check_memory()
        runs = _retrieve_runs(req, n, lay) if req.chains else None
        if runs is None and req.skip_tokens:
            _check_skip(req.skip_tokens, n, lay)
        # staged: chunk j at staged_base + j * object_bytes in the engine's ring (refused here,
        # before acquiring anything)
        staged = req.staging_offset >= 0
        if runs is not None and not staged and reg.cuda_device is not None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "a CUDA engine's retrieve with chains must be staged "
                                                           "(staging_offset >= 0)")
        staged_base = self._staging_base(reg, req.staging_offset, n) if staged else 0
        if promote:
            seq = self._staged_accept(reg, req.staging_seq) if staged and req.staging_seq else 0
            if self.l2 is not None or self.l3 is not None:
                waits = self._promotions(keys, lay.object_bytes)
                if waits:
                    self._staged_begin(reg, seq)  # accepted: a Drain waits for it (`_after_promotions` ends it)
                    self._after_promotions(identity, req, waits)
                    return None
        index = self.index
        ob = lay.object_bytes
        entries: list[Entry] = []
        if runs is None:
            for key in keys:
                e = index.get(key)
                if e is None or e.state is not READY or e.size_bytes != ob:
                    break
                index.acquire(e)
                entries.append(e)
            at = skips = counts = None
        else:  # each run's cached leading chunks, at their own chunk positions
            at, skips, counts = [], [], []
            cs = lay.chunk_size
            for start, end, c in runs:
                before = len(entries)
                for j in range(start, end):
                    e = index.get(keys[j])
                    if e is None or e.state is not READY or e.size_bytes != ob:
                        break
                    index.acquire(e)
                    entries.append(e)
                    at.append(j)
                    skips.append(min(max(c.skip_tokens - (j - start) * cs, 0), cs))
                counts.append(len(entries) - before)
        if reg.cuda_device is not None:
            return self._retrieve_cuda(identity, reg, req, entries, staged_base if staged else None,
                                       at, skips, counts)
        if not entries:
            return m.RetrieveReply(rid=req.rid, retrieved=0, chains=counts or [])
        self._begin_transfer(reg, identity, req.rid)
        t0 = time.perf_counter()
        token = self.watch("retrieve", reg.id, identity, req.rid, len(entries) * lay.object_bytes, reply_pending=True)

        def finish(err: BaseException | None) -> None:
            trace_point(req.rid, "gpu_done")  # (the CPU copy's end, seen by the loop)
            self._finish_transfer(reg, 0, identity, req.rid)
            stuck = self.unwatch(token)  # answered TIMEOUT by the watchdog
            for e in entries:
                self.index.release(e)
            self.index.touch_chain([e.key for e in entries])
            if stuck:
                return
            if err is not None:
                if not isinstance(err, RequestError):
                    err = RequestError(ErrorCode.ENGINE_MEMORY, f"retrieve copy failed: {err}")
                self._reply_error(identity, req.rid, err)
                return
            self._count_transfer(reg, "retrieve", len(entries), time.perf_counter() - t0)
            self._reply(identity, m.RetrieveReply(rid=req.rid, retrieved=len(entries), chains=counts or []))

        if runs is None:
            cs = lay.chunk_size
            writes = [(j, e, min(max(req.skip_tokens - j * cs, 0), cs)) for j, e in enumerate(entries)]
        else:
            writes = list(zip(at, entries, skips))
        trace_point(req.rid, "enqueue")
        try:
            self._in_executor(finish, self._scatter, reg, req.block_ids, writes, req.deadline_ns)
        except BaseException as exc:
            finish(exc)
            return None
        trace_point(req.rid, "r_enqueued")
        return None

    def _retrieve_cuda(self, identity: bytes, reg: Registration, req: m.Retrieve, entries: list[Entry],
                       staged_base: int | None, at: list[int] | None = None, skips: list[int] | None = None,
                       counts: list[int] | None = None) -> m.Msg | None:
        """Enqueue the copies; reply once they completed (the engine's blocks or staging ring
        hold the chunks then: an interprocess event handed out for the engine to wait on was
        found to report a record complete before the copies ran, `KVDepotClient._fence`).
        The entries stay acquired until then. ``staged_base``: chunk 0's address in the
        engine's staging ring (chunk j at ``+ j * object_bytes``; staged), else None (the
        daemon scatters). With ``Retrieve.chains`` (staged only): ``at`` / ``skips`` give each
        entry's chunk position and tokens left alone, ``counts`` each run's chunks found."""
        if not entries:
            return m.RetrieveReply(rid=req.rid, retrieved=0, chains=counts or [])
        self._begin_transfer(reg, identity, req.rid)
        seq = req.staging_seq if staged_base is not None else 0
        self._staged_begin(reg, seq)
        ob = reg.layout.object_bytes
        t0 = time.monotonic()
        token = self.watch("retrieve", reg.id, identity, req.rid, len(entries) * ob, True, t0)
        enqueued = [True]  # set False below if nothing could be enqueued (`_retrieve_cuda_done`)
        done = functools.partial(self._retrieve_cuda_done, identity, reg, req.rid, entries, counts, seq, token, t0,
                                 enqueued)
        if _TRACE is not None:
            trace_point(req.rid, "enqueue")
        base = self.pool.base_ptr
        try:
            if at is not None:  # chains: wholly skipped chunks need no copy
                cs = reg.layout.chunk_size
                srcs = [base + e.offset for e, k in zip(entries, skips) if k < cs]
                if srcs:
                    self._cuda.path(reg.cuda_device).copy_staged(
                        False, srcs, [staged_base + j * ob for j, k in zip(at, skips) if k < cs], ob, None, done)
                else:
                    done(None)
            elif staged_base is not None:
                first = req.skip_tokens // reg.layout.chunk_size  # wholly skipped chunks need no copy
                if first < len(entries):
                    self._cuda.path(reg.cuda_device).copy_staged(
                        False, [base + e.offset for e in entries[first:]],
                        [staged_base + j * ob for j in range(first, len(entries))], ob, None, done,
                        _landed(reg, req, len(entries)))
                else:
                    done(None)
            else:
                self._cuda.path(reg.cuda_device).retrieve(
                    reg.engine, req.block_ids, len(req.keys), [base + e.offset for e in entries], req.skip_tokens,
                    None, done)
        except BaseException:  # raised before anything was enqueued
            enqueued[0] = False  # the caller answers the exception
            done(None)
            raise
        if _TRACE is not None:
            trace_point(req.rid, "r_enqueued")
        self._count_transfer(reg, "retrieve", len(entries))
        self.index.touch_chain([e.key for e in entries])
        return None

    def _retrieve_cuda_done(self, identity: bytes, reg: Registration, rid: int, entries: list[Entry],
                            counts: list[int] | None, seq: int, token: int, t0: float, enqueued: list[bool],
                            err: BaseException | None) -> None:
        """A CUDA retrieve's copies ended (on the loop): release its entries and reply.
        ``enqueued[0]`` False: nothing was enqueued and the caller answers the exception.
        ``counts``: each run's chunks found (``Retrieve.chains``), else None."""
        if _TRACE is not None:
            trace_point(rid, "gpu_done")
        self._finish_transfer(reg, seq, identity, rid)
        stuck = self.unwatch(token)
        release = self.index.release
        for e in entries:
            release(e)
        if not enqueued[0]:
            return
        if err is not None:
            log.error("CUDA retrieve for %s failed on the GPU: %s", reg.id, err)
            if not stuck:
                self._reply_error(identity, rid, RequestError(ErrorCode.ENGINE_MEMORY, f"retrieve copy failed: {err}"))
            return
        self._op_metrics(reg, "retrieve")[2].observe(time.monotonic() - t0)
        if not stuck:
            self._reply(identity, m.RetrieveReply(rid=rid, retrieved=len(entries), chains=counts or []))

    # ------------------------------------------------------------------ Drain (lost staged requests)

    def _staged_accept(self, reg: Registration, seq: int) -> int:
        """A staged request arrived: refused if a `Drain` settled its staging region already
        (it was lost on a connection its client gave up; the region may hold other bytes now).

        Raises:
            RequestError(INVALID_ARGUMENT): ``seq`` <= the registration's drained sequence.
        """
        if seq and seq <= reg.refuse_through:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"staging region {seq} was drained (its request was given up): nothing copied")
        return seq

    def _staged_begin(self, reg: Registration, seq: int) -> None:
        if seq:
            reg.staged_busy[seq] = reg.staged_busy.get(seq, 0) + 1

    def _staged_end(self, reg: Registration, seq: int) -> None:
        """A staged request's copies ended (or it will copy nothing): answer the Drains it held."""
        if not seq:
            return
        busy = reg.staged_busy
        left = busy.get(seq, 0) - 1
        if left > 0:
            busy[seq] = left
        else:
            busy.pop(seq, None)
        if reg.drains:
            low = min(busy) if busy else None
            still = []
            for through, identity, rid in reg.drains:
                if low is not None and low <= through:
                    still.append((through, identity, rid))
                else:
                    self._reply(identity, m.OkReply(rid=rid))
            reg.drains = still

    def _on_drain(self, identity: bytes, req: m.Drain) -> m.Msg | None:
        """`m.Drain`: refuse staged requests up to ``through_seq`` from now on; reply once the
        accepted ones finished."""
        reg = self._registration(req.registration)
        reg.refuse_through = max(reg.refuse_through, req.through_seq)
        if any(seq <= req.through_seq for seq in reg.staged_busy):
            reg.drains.append((req.through_seq, identity, req.rid))
            return None
        return m.OkReply(rid=req.rid)

    # ------------------------------------------------------------------ Settle (lost requests)

    def _settle_end(self, reg: Registration, identity: bytes, rid: int) -> None:
        """A Store / Retrieve's copies ended: answer the Settles it held."""
        busy, key = reg.busy_rids, (identity, rid)
        left = busy[key] - 1
        if left > 0:
            busy[key] = left
        else:
            del busy[key]
        if reg.settles:
            still = []
            for through, who, settle_rid in reg.settles:
                if any(i == who and r <= through for i, r in busy):
                    still.append((through, who, settle_rid))
                else:
                    self._reply(who, m.OkReply(rid=settle_rid))
            reg.settles = still

    def _on_settle(self, identity: bytes, req: m.Settle) -> m.Msg | None:
        """`m.Settle`: refuse this client's requests up to ``through_rid`` from now on; reply
        once the accepted ones finished their copies."""
        reg = self._registration(req.registration)
        if req.through_rid > reg.settled.get(identity, 0):
            reg.settled[identity] = req.through_rid
        if any(i == identity and r <= req.through_rid for i, r in reg.busy_rids):
            reg.settles.append((req.through_rid, identity, req.rid))
            return None
        return m.OkReply(rid=req.rid)

    def _scatter(self, reg: Registration, block_ids, writes: list[tuple[int, Entry, int]], deadline_ns: int = 0) -> None:
        """CPU engines, on a copy thread: write each (chunk position, entry, leading tokens to
        leave alone) into the engine's blocks; no chunk is begun after ``deadline_ns``
        (`Retrieve.deadline_ns`)."""
        eng, cs = reg.engine, reg.layout.chunk_size
        for j, e, skip in writes:
            if deadline_ns:
                _check_deadline(deadline_ns, "retrieve")
            if skip < cs:
                eng.scatter(self.pool.buffer(e.offset, e.size_bytes), self._chunk_block_ids(reg, block_ids, j), skip)


def _stored(reg: Registration, req: m.Store, copied: int) -> tuple[int, int] | None:
    """A landed store's word (`Store.landed`): (device address, `stored_value`) where every
    chunk of the request is copied and its region is fenced under its own number; else None
    (the reply alone ends the store)."""
    if not req.landed or req.chains or copied != len(req.keys) or req.fence != req.staging_seq:
        return None
    return _landed_word(reg, req.staging_seq, copied, m.stored_value)


def _landed(reg: Registration, req: m.Retrieve, retrieved: int) -> tuple[int, int] | None:
    """A gated retrieve's landed word (`Retrieve.landed`): (device address, value) for the
    DMA stream to write after its copies, or None (not gated, or the words are not mapped for
    this daemon's GPU: the engine then writes its word itself when the reply comes)."""
    return _landed_word(reg, req.staging_seq, retrieved, m.landed_value) if req.landed else None


def _landed_word(reg: Registration, seq: int, chunks: int, value) -> tuple[int, int] | None:
    """(device address of region ``seq``'s fence word, ``value(seq, chunks)``) for the DMA stream
    to write after its copies; None where the value cannot carry them or the words are not
    mapped for this daemon's GPU."""
    fence = reg.fence
    if not 0 < seq <= m.LANDED_MAX_SEQ or chunks > m.LANDED_MAX_CHUNKS or fence is None or not fence.dev_ptr:
        return None
    return fence.landed_ptr(seq), value(seq, chunks)


def _runs(req, n: int) -> list[tuple[int, int, m.Chain]]:
    """(start, end, chain) of each run of ``req.chains`` over its ``n`` keys.

    Raises:
        RequestError(INVALID_ARGUMENT): the first run does not start at 0, starts do not
            increase, or one lies past the keys.
    """
    chains = req.chains
    starts = [c.start for c in chains]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
        raise RequestError(ErrorCode.INVALID_ARGUMENT,
                           f"chains must start at 0 with increasing starts below the {n} keys; got starts {starts}")
    ends = starts[1:] + [n]
    return list(zip(starts, ends, chains))


def _store_runs(req: m.Store, n: int) -> list[tuple[int, int, bytes]]:
    """(start, end, parent) of each run of a `Store` with ``chains`` (see `_runs`).

    Raises:
        RequestError(INVALID_ARGUMENT): as `_runs`, or ``parent`` given beside ``chains``.
    """
    if req.parent:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "a store with chains gives each run's parent in its chain; "
                                                       "its parent field must be empty")
    return [(s, e, c.parent) for s, e, c in _runs(req, n)]


def _check_skip(skip_tokens: int, num_chunks: int, lay) -> None:
    """Raises RequestError(INVALID_ARGUMENT) unless ``skip_tokens`` is a multiple of every
    group's tokens per block and less than the ``num_chunks`` chunks' tokens."""
    if skip_tokens >= num_chunks * lay.chunk_size or any(skip_tokens % t for t in lay.tokens_per_block):
        raise RequestError(ErrorCode.INVALID_ARGUMENT,
                           f"skip_tokens {skip_tokens} must be a multiple of every group's tokens per block "
                           f"{lay.tokens_per_block} and less than {num_chunks * lay.chunk_size}")


def _retrieve_runs(req: m.Retrieve, n: int, lay) -> list[tuple[int, int, m.Chain]]:
    """`_runs` of a `Retrieve` with ``chains``, each run's ``skip_tokens`` checked (`_check_skip`).

    Raises:
        RequestError(INVALID_ARGUMENT): as `_runs` or `_check_skip`, or ``skip_tokens`` given
            beside ``chains``.
    """
    if req.skip_tokens:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "a retrieve with chains gives each run's skip_tokens in its "
                                                       "chain; its skip_tokens field must be 0")
    runs = _runs(req, n)
    for s, e, c in runs:
        if c.skip_tokens:
            _check_skip(c.skip_tokens, e - s, lay)
    return runs


def _check_settled(reg: Registration, identity: bytes, rid: int) -> None:
    """Raise INVALID_ARGUMENT for a request its client settled already (`m.Settle`)."""
    if rid <= reg.settled.get(identity, 0):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"request {rid} was settled as lost by its client "
                                                       "(`Settle`): nothing copied")


def _check_deadline(deadline_ns: int, op: str) -> None:
    """Raise DEADLINE once ``CLOCK_MONOTONIC`` passed ``deadline_ns`` (`Store.deadline_ns`)."""
    late_ns = time.monotonic_ns() - deadline_ns
    if late_ns >= 0:
        raise RequestError(ErrorCode.DEADLINE, f"the {op}'s deadline passed {late_ns / 1e6:.1f} ms before its copy "
                                               "began; the engine may have reused its blocks, nothing was copied")


def _stalled(stall_s: float, fn, *args):
    time.sleep(stall_s)
    return fn(*args)
