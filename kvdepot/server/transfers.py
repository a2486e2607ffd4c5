"""STORE and RETRIEVE (`TransferService`): planning on the loop (index, L1 allocation), the
copies (CPU engines on the thread pool, CUDA engines through `kvdepot.gpu.cuda_path`), and the
reply from their completion."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from kvdepot import trace
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.server.checks import (check_deadline, check_settled, check_skip, landed_word, retrieve_runs, stalled,
                                   store_runs, stored_word)
from kvdepot.server.faults import InjectedFaults
from kvdepot.server.index import Entry, EntryState
from kvdepot.server.registration import Registration
from kvdepot.server.settle import Settlements
from kvdepot.server.tiering import Tiers
from kvdepot.server.watchdog import CopyWatchdog

READY = EntryState.READY

log = logging.getLogger("kvdepot.daemon")
_TRACE = trace.POINTS  # None unless KVDEPOT_TRACE_FILE is set (see kvdepot/trace.py)
trace_point = trace.point
# values of kvdepot_store_skipped_chunks_total{reason}
STORE_SKIP_REASONS = ("parent_missing", "capacity")


class TransferService:
    """The Store / Retrieve handlers (see the module docstring).

    Args:
        registrations: the daemon's registrations by id (read).
        registration: the daemon's lookup of one by id (raises UNKNOWN_REGISTRATION).
        tiers: L1 (index, pool, allocation) and the lower tiers (write-through, promotion).
        watchdog: deadlines of the copies in flight.
        settlements: Drains and Settles held by the requests' copies.
        front: answers a request whose copies ended.
        executor: the CPU engines' copy threads.
        cuda_path: the CUDA copy path of a device (`kvdepot.gpu.cuda_path`).
        metrics: the daemon's `kvdepot.server.metrics.Metrics`.
        faults: injected copy stalls (soak tests only), or None.

    Attributes:
        stored_chunks, retrieved_chunks: totals (`describe`).
    """

    def __init__(self, registrations: dict[str, Registration], registration: Callable[[str], Registration],
                 tiers: Tiers, watchdog: CopyWatchdog, settlements: Settlements, front, executor: Executor,
                 cuda_path: Callable, metrics, faults: InjectedFaults | None) -> None:
        self.registrations = registrations
        self._registration = registration
        self.tiers = tiers
        self.index = tiers.index
        self.pool = tiers.pool
        self.watchdog = watchdog
        self.settlements = settlements
        self.front = front
        self._executor = executor
        self._cuda_path = cuda_path
        self.metrics = metrics
        self._faults = faults
        self._tasks: set[asyncio.Task] = set()  # retrieves waiting for promotions
        self.stored_chunks = 0
        self.retrieved_chunks = 0

    def close(self) -> None:
        """Cancel the retrieves still waiting for promotions (at the daemon's stop)."""
        for task in list(self._tasks):
            task.cancel()


    def on_store(self, identity: bytes, req: m.Store) -> m.Msg | None:
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
            check_settled(reg, identity, req.rid)
        if req.deadline_ns:
            check_deadline(req.deadline_ns, "store")
        runs = store_runs(req, n) if req.chains else ((0, n, req.parent),)
        if reg.files:
            reg.check_memory()
        staged = req.staging_offset >= 0  # a CPU registration has no staging: refused in _staging_base
        staged_base = self._staging_base(reg, req.staging_offset, n) if staged else 0
        seq = self.settlements.staged_accept(reg, req.staging_seq) if staged and req.staging_seq else 0
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
        l2 = self.tiers.l2
        events = self.tiers.events
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
                            events.stored(reg.model, key)  # (held: told again to whoever planned it now)
                            parent = key
                            continue
                    if e is not None:
                        if e.size_bytes != ob:
                            reason = "parent_missing"  # another object format under this key: never chain onto it
                            break
                        if e.state is READY:  # (else WRITING: no reader may hold it; its children keep it)
                            index.acquire(e)
                            held.append(e)
                            events.stored(reg.model, key)
                        c_present += 1
                    else:
                        off = self.tiers.alloc(ob, req.cache_salt)
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
        self.settlements.staged_begin(reg, seq)
        t0 = time.monotonic()
        token = self.watchdog.watch("store", reg.id, identity, req.rid, len(new) * ob, True, t0)
        finish = functools.partial(self._store_done, identity, reg, req, reply, new, held, seq, token, t0)
        if _TRACE is not None:
            trace_point(req.rid, "enqueue")
        try:
            if reg.cuda_device is None:
                self._in_executor(finish, self._gather, reg, req.block_ids, new, req.deadline_ns)
            elif staged:
                base = self.pool.base_ptr
                self._cuda_path(reg.cuda_device).copy_staged(
                    True, [staged_base + j * ob for j, _ in new], [base + e.offset for _, e in new], ob, fence, finish,
                    stored_word(reg, req, len(new)))
            else:
                base = self.pool.base_ptr
                self._cuda_path(reg.cuda_device).store(
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
        stuck = self.watchdog.unwatch(token)  # answered TIMEOUT by the watchdog: publish nothing, reply nothing
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
                self.front.reply_error(identity, req.rid, err)
                return
            for _, e in new:
                index.commit(e)
            self.tiers.committed([e for _, e in new])
            elapsed_s = time.monotonic() - t0
            self.front.reply(identity, reply)  # before the metrics: a lone store waits for this reply
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
            fn = functools.partial(stalled, stall_s, fn)
        fut = asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

        def done(f: asyncio.Future) -> None:
            finish(asyncio.CancelledError() if f.cancelled() else f.exception())

        fut.add_done_callback(done)

    def _gather(self, reg: Registration, block_ids, new: list[tuple[int, Entry]], deadline_ns: int = 0) -> None:
        """CPU engines, on a copy thread: read each new chunk out of the engine's blocks (not
        begun after ``deadline_ns``, `Store.deadline_ns`)."""
        if deadline_ns:
            check_deadline(deadline_ns, "store")
        eng = reg.engine
        for j, e in new:
            eng.gather(self.pool.buffer(e.offset, e.size_bytes), self._chunk_block_ids(reg, block_ids, j))

    def on_retrieve(self, identity: bytes, req: m.Retrieve, promote: bool = True) -> m.Msg | None:
        """``promote``: chunks only L2 holds are read into L1 first (the reply then comes once
        they are; `Tiers.promotions`)."""
        reg = self.registrations.get(req.registration) or self._registration(req.registration)
        lay = reg.layout
        keys = req.keys
        n = len(keys)
        self._check_block_ids(reg, req.block_ids, n)
        if reg.settled:
            check_settled(reg, identity, req.rid)
        if req.deadline_ns:
            check_deadline(req.deadline_ns, "retrieve")
        if reg.files:
            reg.check_memory()
        runs = retrieve_runs(req, n, lay) if req.chains else None
        if runs is None and req.skip_tokens:
            check_skip(req.skip_tokens, n, lay)
        # staged: chunk j at staged_base + j * object_bytes in the engine's ring (refused here,
        # before acquiring anything)
        staged = req.staging_offset >= 0
        if runs is not None and not staged and reg.cuda_device is not None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "a CUDA engine's retrieve with chains must be staged "
                                                           "(staging_offset >= 0)")
        staged_base = self._staging_base(reg, req.staging_offset, n) if staged else 0
        if promote:
            seq = self.settlements.staged_accept(reg, req.staging_seq) if staged and req.staging_seq else 0
            if self.tiers.l2 is not None or self.tiers.l3 is not None:
                waits = self.tiers.promotions(keys, lay.object_bytes)
                if waits:
                    self.settlements.staged_begin(reg, seq)  # accepted: a Drain waits for it (`_after_promotions` ends it)
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
        token = self.watchdog.watch("retrieve", reg.id, identity, req.rid, len(entries) * lay.object_bytes, reply_pending=True)

        def finish(err: BaseException | None) -> None:
            trace_point(req.rid, "gpu_done")  # (the CPU copy's end, seen by the loop)
            self._finish_transfer(reg, 0, identity, req.rid)
            stuck = self.watchdog.unwatch(token)  # answered TIMEOUT by the watchdog
            for e in entries:
                self.index.release(e)
            self.index.touch_chain([e.key for e in entries])
            if stuck:
                return
            if err is not None:
                if not isinstance(err, RequestError):
                    err = RequestError(ErrorCode.ENGINE_MEMORY, f"retrieve copy failed: {err}")
                self.front.reply_error(identity, req.rid, err)
                return
            self._count_transfer(reg, "retrieve", len(entries), time.perf_counter() - t0)
            self.front.reply(identity, m.RetrieveReply(rid=req.rid, retrieved=len(entries), chains=counts or []))

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
        found to report a record complete before the copies ran, `kvdepot.client.staged.Stager.fence`).
        The entries stay acquired until then. ``staged_base``: chunk 0's address in the
        engine's staging ring (chunk j at ``+ j * object_bytes``; staged), else None (the
        daemon scatters). With ``Retrieve.chains`` (staged only): ``at`` / ``skips`` give each
        entry's chunk position and tokens left alone, ``counts`` each run's chunks found."""
        if not entries:
            return m.RetrieveReply(rid=req.rid, retrieved=0, chains=counts or [])
        self._begin_transfer(reg, identity, req.rid)
        seq = req.staging_seq if staged_base is not None else 0
        self.settlements.staged_begin(reg, seq)
        ob = reg.layout.object_bytes
        t0 = time.monotonic()
        token = self.watchdog.watch("retrieve", reg.id, identity, req.rid, len(entries) * ob, True, t0)
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
                    self._cuda_path(reg.cuda_device).copy_staged(
                        False, srcs, [staged_base + j * ob for j, k in zip(at, skips) if k < cs], ob, None, done)
                else:
                    done(None)
            elif staged_base is not None:
                first = req.skip_tokens // reg.layout.chunk_size  # wholly skipped chunks need no copy
                if first < len(entries):
                    self._cuda_path(reg.cuda_device).copy_staged(
                        False, [base + e.offset for e in entries[first:]],
                        [staged_base + j * ob for j in range(first, len(entries))], ob, None, done,
                        landed_word(reg, req, len(entries)))
                else:
                    done(None)
            else:
                self._cuda_path(reg.cuda_device).retrieve(
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
        stuck = self.watchdog.unwatch(token)
        release = self.index.release
        for e in entries:
            release(e)
        if not enqueued[0]:
            return
        if err is not None:
            log.error("CUDA retrieve for %s failed on the GPU: %s", reg.id, err)
            if not stuck:
                self.front.reply_error(identity, rid, RequestError(ErrorCode.ENGINE_MEMORY, f"retrieve copy failed: {err}"))
            return
        self._op_metrics(reg, "retrieve")[2].observe(time.monotonic() - t0)
        if not stuck:
            self.front.reply(identity, m.RetrieveReply(rid=rid, retrieved=len(entries), chains=counts or []))

    def _after_promotions(self, identity: bytes, req: m.Retrieve, waits: list[asyncio.Future]) -> None:
        """Run the retrieve once its chunks' promotions ended (whatever they found: the retrieve
        then serves the leading chunks L1 holds)."""

        async def run() -> None:
            await asyncio.gather(*waits)
            try:
                reply = self.on_retrieve(identity, req, promote=False)
            except Exception as exc:  # noqa: BLE001 - every failure becomes a typed reply
                self.front.reply_error(identity, req.rid, exc)
                return
            finally:  # accepted at arrival (`on_retrieve`); its copies, if any, hold it again
                reg = self.registrations.get(req.registration)
                if reg is not None and req.staging_offset >= 0:
                    self.settlements.staged_end(reg, req.staging_seq)
            if reply is not None:
                self.front.reply(identity, reply)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _check_block_ids(self, reg: Registration, block_ids: Sequence[Sequence[int]], num_chunks: int) -> None:
        lay = reg.layout
        if len(block_ids) != len(lay.chunk_blocks):
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"block_ids has {len(block_ids)} groups, registration has {len(lay.chunk_blocks)}")
        for gid, (ids, per_chunk, nb) in enumerate(zip(block_ids, lay.chunk_blocks, lay.num_blocks)):
            if len(ids) != num_chunks * per_chunk:
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"gid {gid}: {len(ids)} block ids for {num_chunks} chunks, need {num_chunks * per_chunk}")
            if ids and max(ids) >= nb:  # ids are >= 0, or -1 in a RETRIEVE (the decoder checks)
                raise RequestError(ErrorCode.INVALID_ARGUMENT,
                                   f"gid {gid}: block id {max(ids)} out of range [0, {nb})")

    @staticmethod
    def _chunk_block_ids(reg: Registration, block_ids: Sequence[Sequence[int]], j: int) -> list[Sequence[int]]:
        out = []
        for gid, ids in enumerate(block_ids):
            n = reg.layout.blocks_per_chunk(gid)
            out.append(ids[j * n : (j + 1) * n])
        return out

    def _op_metrics(self, reg: Registration, op: str) -> tuple:
        """(bytes counter, tokens counter, seconds histogram) series for ``reg``'s model and
        ``op``, looked up once per registration (``labels()`` is not free on the hot path)."""
        got = reg.metric_children.get(op)
        if got is None:
            got = reg.metric_children[op] = (self.metrics.bytes.labels(reg.model, op),
                                             self.metrics.tokens.labels(reg.model, op),
                                             self.metrics.transfer_seconds.labels(op))
        return got

    def _count_transfer(self, reg: Registration, op: str, num_chunks: int, seconds: float | None = None) -> None:
        """Metrics and describe() counters of ``num_chunks`` chunks moved by ``op``."""
        mb, mt, ms = self._op_metrics(reg, op)
        if seconds is not None:
            ms.observe(seconds)
        lay = reg.layout
        mb.value += num_chunks * lay.object_bytes  # (CounterCell.inc, without its check: never negative here)
        mt.value += num_chunks * lay.chunk_size
        if op == "store":
            reg.stored_chunks += num_chunks
            self.stored_chunks += num_chunks
        else:
            reg.retrieved_chunks += num_chunks
            self.retrieved_chunks += num_chunks

    def _begin_transfer(self, reg: Registration, identity: bytes, rid: int) -> None:
        """A Store / Retrieve starts copies (ended by `_finish_transfer`)."""
        reg.active += 1
        reg.busy_rids[(identity, rid)] += 1

    def _finish_transfer(self, reg: Registration, staging_seq: int = 0, identity: bytes = b"", rid: int = 0) -> None:
        reg.active -= 1
        if staging_seq:
            self.settlements.staged_end(reg, staging_seq)
        if rid:
            self.settlements.settle_end(reg, identity, rid)
        if reg.closed and reg.active == 0:
            reg.release_memory()

    @staticmethod
    def _staging_base(reg: Registration, offset: int, num_chunks: int) -> int:
        """Device address of a request's chunk 0 in the engine's staging buffer (chunk j at
        ``+ j * object_bytes``), for a request of ``num_chunks`` chunks at byte ``offset``.

        Raises:
            RequestError(INVALID_ARGUMENT): no staging buffer was registered (or this daemon
                does not serve staged transfers), or the chunks lie outside it / misaligned.
        """
        if not reg.staging_bytes:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "staging_offset given but the registration has no staging "
                                                           "buffer this daemon serves (RegisterReply.staging)")
        end = offset + num_chunks * reg.layout.object_bytes
        if offset % 256 or end > reg.staging_bytes:
            raise RequestError(ErrorCode.INVALID_ARGUMENT,
                               f"staging_offset {offset}: chunks up to byte {end} do not fit the {reg.staging_bytes}-byte "
                               "staging buffer, or the offset is not a multiple of 256")
        return reg.staging_ptr + offset

    def _scatter(self, reg: Registration, block_ids, writes: list[tuple[int, Entry, int]], deadline_ns: int = 0) -> None:
        """CPU engines, on a copy thread: write each (chunk position, entry, leading tokens to
        leave alone) into the engine's blocks; no chunk is begun after ``deadline_ns``
        (`Retrieve.deadline_ns`)."""
        eng, cs = reg.engine, reg.layout.chunk_size
        for j, e, skip in writes:
            if deadline_ns:
                check_deadline(deadline_ns, "retrieve")
            if skip < cs:
                eng.scatter(self.pool.buffer(e.offset, e.size_bytes), self._chunk_block_ids(reg, block_ids, j), skip)
