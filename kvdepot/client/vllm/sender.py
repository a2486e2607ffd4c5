"""The worker's sender (`Sender`), on the transfer thread (`kvdepot.client.vllm.mover`): jobs
into pieces in the queue (`Planner`), the ways a store's chunks reach the staging ring (gathered
on the thread's stream after an engine event, or on the engine's stream: `Sender.stage_saves`),
and the sending of queued pieces as the ring has room (`Sender.pump`). Replies are read and the
ops ended by the thread (`TransferThread._collect`)."""

from __future__ import annotations

import collections
import itertools
import logging
import time
from collections.abc import Callable, Collection

from kvdepot.client.client import KVDepotClient
from kvdepot.client.many import RetrieveItem, StoreItem
from kvdepot.client.vllm.commands import SharedRegion, StagedPiece, StagedSaves
from kvdepot.client.vllm.pieces import Book, Load, Op, Piece
from kvdepot.client.vllm.plan import LoadJob, StoreJob
from kvdepot.client.vllm.planner import Planner
from kvdepot.gpu.kernels import KernelError
from kvdepot.protocol.errors import ErrorCode, KVDepotError

log = logging.getLogger("kvdepot.vllm")

# errors after which the daemon is treated as down (pinged until it answers) rather than as
# having refused one request
DOWN = (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE, ErrorCode.DISCONNECTED, ErrorCode.INTERNAL, ErrorCode.BACKPRESSURE)
_MAX_RUNS = 64  # queued pieces sent in one request at most (`Sender._batch`)


class Sender:
    """Queues one worker's pieces and sends them (see the module docstring). Runs on the
    transfer thread, except `stage_saves`, which the engine thread may call too.

    Args:
        side: the `kvdepot.client.vllm.worker.WorkerConnector` (read: its registration, ``ready()``,
            ``stores_skip_when_full``; counted: its ``stats``).
        client: the worker's client (the transfer thread's).
        planner: keys, block ids and pieces of the jobs.
        book: the pieces queued and in flight, the stopped requests and the loads' outcomes.
        collect: ends the ops whose answer is in (`TransferThread._collect`); `pump` calls it first.

    Attributes:
        stream: the thread's side stream (CUDA; None on CPU, or before the thread started),
            on which the gathers and scatters of queued pieces go.
    """

    def __init__(self, side, client: KVDepotClient, planner: Planner, book: Book,
                 collect: Callable[[], None]) -> None:
        self.side = side
        self.registrar = side.registrar
        self.cfg = side.cfg
        self.client = client
        self.planner = planner
        self.book = book
        self._collect = collect
        self.stream = None

    def load(self, job: LoadJob, ready: bool, null_id: int, event) -> None:
        side = self.side
        side.stats["loads"] += 1
        if not (ready and job.chain and all(job.block_ids)):
            self.book.loads.finish(job, 0)
            return
        keys = self.planner.keys(job.chain, job.seed)
        c = self.cfg.chunk_size
        per = self.planner.piece_chunks("load")
        reg = self.registrar.reg
        ids = [self.planner.block_ids(reg, g, b, null_id) for g, b in enumerate(job.block_ids)]
        bpc = [c // gs.tokens_per_block for gs in reg.groups]
        if not self.planner.window_blocks_only(ids, bpc):
            self.book.loads.finish(job, 0)  # vLLM recomputes it
            return
        starts = list(range(0, len(keys), per))
        load = Load(job, [None] * len(starts), [min(per, len(keys) - s) for s in starts])
        now = time.monotonic()
        # ahead of the stores waiting for ring room (a request waits for its load; nobody waits
        # for a store): queued pieces hold no room yet, and no load reads a chunk a store of
        # this queue writes (the daemon answered the lookup before those stores were sent)
        q = self.book.queue
        at = next((k for k, x in enumerate(q) if x.kind == "store"), len(q))
        for i, s in enumerate(starts):
            e = s + load.chunks[i]
            q.insert(at + i, Piece(job.req_id, "load", keys[s:e], [x[s * n:e * n] for x, n in zip(ids, bpc)],
                                   skip_tokens=job.skip_tokens if i == 0 else 0, load=load, index=i,
                                   queued_at=now, after=event))

    def save(self, jobs: list[StoreJob], event) -> None:
        side = self.side
        ready = self.registrar.ready()
        now = time.monotonic()
        first_new = len(self.book.queue)
        for job in jobs:
            if not ready or job.req_id in self.book.stopped or not job.chain or not self._sliced(job):
                side.stats["store_failures"] += 1
                continue
            keys = self.planner.keys(job.chain, job.seed)
            parent = self.planner.keys([job.parent], job.seed)[0] if job.parent else b""
            for s, e, ids in self.planner.store_pieces(job):
                self.book.queue.append(Piece(job.req_id, "store", keys[s:e], ids, parent=parent if s == 0 else keys[s - 1],
                                          cache_salt=job.cache_salt, queued_at=now, after=event))
        new = [self.book.queue[i] for i in range(first_new, len(self.book.queue))] if side.stores_skip_when_full else ()
        self.pump(stores_now=True)
        if new and self.book.queue:
            # sliding-window models: gathered now or never (a load waiting for ring room ahead
            # of them held them back; later, the blocks may be another request's)
            late = {id(p) for p in new}
            kept = collections.deque()
            for p in self.book.queue:
                if id(p) in late:
                    side.stats["stores_skipped_ring_full"] += 1
                    self.book.stopped.add(p.req_id)
                else:
                    kept.append(p)
            self.book.queue = kept

    def _sliced(self, job: StoreJob) -> bool:
        """`StoreJob.slice_block_ids`, here on the transfer thread; a job whose blocks include
        vLLM's null block where none can be is not stored, nor any later chunk of its request."""
        if job.block_ids is not None or job.slice_block_ids():
            return True
        log.warning("kvdepot: request %s: vLLM's null block among the blocks of chunks %d..%d; they and its "
                    "later chunks are not stored", job.req_id, job.first_chunk, job.first_chunk + len(job.chain) - 1)
        self.book.stopped.add(job.req_id)
        return False

    def stage_saves(self, jobs: list[StoreJob], stream, stopped: Collection[str] = ()) -> StagedSaves | None:
        """CUDA models with a sliding-window group, fence words in use: gather a step's
        stores into the staging ring now, on ``stream`` (the engine's), so that no forward
        enqueued later can overwrite their blocks first. Called by the transfer thread when it
        takes the save, or by the engine thread in ``bind_connector_metadata`` if it claimed the save first
        (`kvdepot.client.vllm.pieces.PostedSave`); the thread sends them (`send_staged`). A piece that finds no room now is
        skipped, and the rest of its request with it (vLLM may hand its blocks to another
        request in the next step).

        Several jobs of one piece each (one-chunk requests, many per step) are gathered together
        into one region by one call (`_stage_together`), where the daemon takes several runs
        per request; the pieces of a job of several are gathered by one call into their regions
        (`_stage_pieces`): each gather call costs the engine thread ~30 us.

        ``stopped``: requests not to gather (the transfer thread passes its own set; the engine
        thread passes none and reads no state of the transfer thread's: `send_staged` gives up
        the regions of requests stopped meanwhile). Reads the client's generation and the
        worker's registration (one reference each) and allocates in the staging ring (locked).

        Returns what was gathered (`StagedSaves`), or None: the ring or its fence words are not
        in use now (the thread gathers, after an event)."""
        c = self.client
        kvreg = self.registrar.kvreg
        if (kvreg is None or kvreg.staging is None or not kvreg.staging.fence_active
                or self.registrar.generation != c.generation):
            return None
        out: list[list[StagedPiece] | None] = []
        shared = self._stage_together(kvreg, jobs, stream, stopped) if kvreg.chains and len(jobs) > 1 else None
        for job in jobs:
            if shared is not None and job.req_id in shared.jobs:
                out.append([])
                continue
            if job.req_id in stopped or not job.chain:
                out.append(None)
                continue
            ids = self.planner.job_ids(job)
            parts = self.planner.store_pieces(job, ids)
            pieces = self._stage_pieces(kvreg, job, ids, parts, stream) if len(parts) > 1 else None
            if pieces is not None:
                out.append(pieces)
                continue
            pieces = []
            for s, e, piece_ids in parts:
                try:
                    region = c.stage_store(kvreg, piece_ids, e - s, stream, wait_for_room=False)
                except KernelError as exc:
                    log.warning("kvdepot: gather of request %s's chunks failed: %s", job.req_id, exc)
                    region = None
                pieces.append(StagedPiece(s, e, piece_ids, region))
                if region is None:
                    break  # the rest would have no parent
            out.append(pieces)
        return StagedSaves(c.generation, kvreg, out, shared)

    def _stage_pieces(self, kvreg, job: StoreJob, ids: list[list[int]], parts: list,
                      stream) -> list[StagedPiece] | None:
        """`stage_saves` of a job of several pieces (``ids``: all its chunks' block ids): one
        gather call for all of them, each into its own region (`kvdepot.client.KVDepotClient.stage_store_pieces`);
        None: no room for all of them now (the caller stages them one by one)."""
        try:
            regions = self.client.stage_store_pieces(kvreg, ids, [e - s for s, e, _ in parts], stream)
        except KernelError as exc:
            log.warning("kvdepot: gather of request %s's chunks failed: %s", job.req_id, exc)
            return None
        if regions is None:
            return None
        return [StagedPiece(s, e, piece_ids, region) for (s, e, piece_ids), region in zip(parts, regions)]

    def _stage_together(self, kvreg, jobs: list[StoreJob], stream, stopped: Collection[str]) -> SharedRegion | None:
        """`stage_saves`'s shared gather: the jobs whose store is one piece, of the first such
        job's cache salt, as many as fit in a piece, in one region by one gather call. None:
        fewer than two such jobs, or no room now (each job is then staged alone)."""
        per = self.planner.piece_chunks()
        picked, n = [], 0
        for job in jobs:
            k = len(job.chain)
            if (job.req_id in stopped or not job.chain or k > per - n
                    or (picked and job.cache_salt != picked[0].cache_salt)):
                continue
            picked.append(job)
            n += k
        if len(picked) < 2:
            return None
        reg = self.registrar.reg
        flat = [[] for _ in reg.groups]
        ids_of = {}
        for job in picked:
            ids_of[job.req_id] = job_ids = self.planner.store_pieces(job)[0][2]
            for out, ids in zip(flat, job_ids):
                out.extend(ids)
        try:
            region = self.client.stage_store(kvreg, flat, n, stream, wait_for_room=False)
        except KernelError as exc:
            log.warning("kvdepot: gather of %d requests' chunks failed: %s", len(picked), exc)
            return None
        if region is None:
            return None
        return SharedRegion(region, {job.req_id: (job, ids_of[job.req_id]) for job in picked})

    def send_staged(self, jobs: list[StoreJob], staged: StagedSaves) -> None:
        """Send the stores `stage_saves` gathered; give up the regions of those that cannot go
        (daemon restarted or down, request stopped): free once their gathers ran."""
        side, c = self.side, self.client
        kvreg, shared = staged.registration, staged.shared
        registrar = self.registrar
        ok = registrar.ready() and registrar.kvreg is kvreg and staged.generation == c.generation and c.up
        now = time.monotonic()
        if shared is not None:
            ok = self._send_together(kvreg, shared, ok, now)
        for job, pieces in zip(jobs, staged.per_job):
            if shared is not None and job.req_id in shared.jobs:
                continue
            if pieces is None:
                side.stats["store_failures"] += 1
                continue
            keys: list[bytes] = []
            for piece in pieces:
                s, e, ids, region = piece.first, piece.end, piece.block_ids, piece.region
                if region is None:
                    side.stats["stores_skipped_ring_full"] += 1
                    self.book.stopped.add(job.req_id)
                    continue
                if not ok or job.req_id in self.book.stopped:
                    c.abandon_region(kvreg, region)
                    side.stats["store_failures"] += 1
                    self.book.stopped.add(job.req_id)
                    continue
                if not keys:
                    keys = self.planner.keys(job.chain, job.seed)
                parent = keys[s - 1] if s else (self.planner.keys([job.parent], job.seed)[0] if job.parent else b"")
                p = Piece(job.req_id, "store", keys[s:e], ids, parent=parent, cache_salt=job.cache_salt,
                          queued_at=now)
                try:
                    pending = c.submit_store(kvreg, p.keys, ids, parent, job.cache_salt, job.req_id, staged=region)
                except KVDepotError as exc:  # the region was given up
                    if exc.code in DOWN:
                        c.mark_down()
                    ok = False
                    self.book.drop(p, str(exc))
                    continue
                self.book.ops.append(Op(p, pending, c.generation, time.monotonic()))

    def _send_together(self, kvreg, together: SharedRegion, ok: bool, now: float) -> bool:
        """Send the jobs `_stage_together` gathered into one region as one request (a run per
        job); returns False if the daemon turned out to be down (the caller's ``ok``)."""
        from kvdepot.client.many import StoreItem

        side, c = self.side, self.client
        region, jobs = together.region, together.jobs
        live = list(jobs.values())  # (one stopped since its gather still stores what was gathered: its bytes are right)
        if not ok:
            c.abandon_region(kvreg, region)
            for job, _ in live:
                side.stats["store_failures"] += 1
                self.book.stopped.add(job.req_id)
            return ok
        pieces, items = [], []
        for job, ids in live:
            keys = self.planner.keys(job.chain, job.seed)
            parent = self.planner.keys([job.parent], job.seed)[0] if job.parent else b""
            pieces.append(Piece(job.req_id, "store", keys, ids, parent=parent, cache_salt=job.cache_salt,
                                queued_at=now))
            items.append(StoreItem(keys, ids, parent))
        try:
            pending = c.submit_store_many(kvreg, items, live[0][0].cache_salt, staged=region)
        except KVDepotError as exc:  # the region was given up
            if exc.code in DOWN:
                c.mark_down()
            for p in pieces:
                self.book.drop(p, str(exc))
            return False
        for i, p in enumerate(pieces):
            self.book.ops.append(Op(p, pending, c.generation, time.monotonic(), run=i))
        return ok

    def await_unstaged(self, ops: list[Op]) -> None:
        """Sliding-window models: a store the daemon copies from the blocks itself (CPU engines,
        or CUDA without engine-side staging) is "gathered" only once the daemon answered it, so
        that `saves_gathered` means the bytes left the blocks (the next forward may reuse them)."""
        for op in ops:
            if op.piece.kind == "store" and op.pending._region is None:
                try:
                    op.pending.result(timeout_s=_hold_s(op, self.cfg.rpc_timeout_s))
                except KVDepotError:
                    pass  # `_collect` books the failure

    def drop_preempted(self, gone: set[str]) -> None:
        """The transfer thread, for a preemption (`TransferThread._preempt`): the queued stores
        of ``gone`` are dropped (counted as failed, their later chunks skipped); a store in
        flight that the daemon gathers from the blocks itself (no staging) is waited for."""
        kept = collections.deque()
        for piece in self.book.queue:
            if piece.req_id in gone and piece.kind == "store":
                self.side.stats["store_failures"] += 1
                self.book.stopped.add(piece.req_id)
            else:
                kept.append(piece)
        self.book.queue = kept
        for op in self.book.ops:
            if op.piece.req_id in gone and op.piece.kind == "store" and op.pending._region is None:
                try:
                    op.pending.result(timeout_s=_hold_s(op, self.cfg.rpc_timeout_s))
                except KVDepotError as exc:
                    log.error("kvdepot: store of preempted request %s did not end (%s); its blocks are reused now",
                              op.piece.req_id, exc)

    # ------------------------------------------------------------------ sending

    def pump(self, stores_now: bool = False) -> None:
        """Send queued pieces, in order, while the staging ring has room (never waits for it).
        ``stores_now``: this step's stores must be gathered now or never (sliding-window models).
        Where loads have a ring of their own (`EngineStaging.load_ring`), a load without room
        does not hold back the stores queued behind it, nor they the loads."""
        q = self.book.queue
        if not q:
            return
        side, c = self.side, self.client
        c.poll()
        self._collect()
        kvreg = self.registrar.kvreg
        stream = self.stream
        waited = None  # the engine event the side stream waits on already
        # kinds whose ring had no room in this pass (one ring: a full ring stops both)
        full: set[str] = set()
        own_load_ring = kvreg is not None and kvreg.staging is not None and len(kvreg.staging.rings) > 1
        at = 0  # the queue's first piece of a kind not in ``full`` (loads come before stores)
        while at < len(q):
            p = q[at]
            if p.kind in full:
                at += 1
                continue
            if kvreg is None or self.registrar.generation != c.generation or not c.up:
                self.book.drop(self.book.take(at), "the daemon is not available")
                continue
            if p.kind == "store" and p.req_id in self.book.stopped:
                self.book.take(at)
                side.stats["store_failures"] += 1
                continue
            batch = self._batch(kvreg, at)
            for b in batch:
                if stream is not None and b.after is not None and b.after is not waited:
                    stream.wait_event(b.after)  # GPU-side: after the engine's forward / block allocation
                    waited = b.after
            try:
                pending = self._submit(kvreg, batch, stream)
                if pending is None and len(batch) > 1:  # no room for all of them: the first alone
                    batch = batch[:1]
                    pending = self._submit(kvreg, batch, stream)
            except KVDepotError as exc:
                if exc.code in DOWN:
                    c.mark_down()
                self.book.drop(self.book.take(at), str(exc))
                continue
            if pending is None:  # no room in the ring now
                if p.kind == "store" and (stores_now and side.stores_skip_when_full):
                    self.book.take(at)
                    side.stats["stores_skipped_ring_full"] += 1
                    self.book.stopped.add(p.req_id)
                    continue
                if time.monotonic() - p.queued_at > self.cfg.rpc_timeout_s:
                    self.book.take(at)  # the daemon drains the ring too slowly
                    if p.kind == "store":
                        side.stats["stores_skipped_ring_full"] += 1
                        self.book.stopped.add(p.req_id)
                    else:
                        self.book.loads.piece_ended(p, 0)  # recomputed
                    continue
                if not p.waited:  # a piece waits once however many pumps find the ring still full
                    p.waited = True
                    side.stats["pieces_queued"] += 1
                if not own_load_ring:
                    break
                full.add(p.kind)
                continue
            now = time.monotonic()
            if len(batch) == 1:
                self.book.take(at)
                self.book.ops.append(Op(p, pending, c.generation, now))
                continue
            for i, b in enumerate(batch):
                self.book.take(at)
                self.book.ops.append(Op(b, pending, c.generation, now, run=i))

    def _batch(self, kvreg, at: int = 0) -> list[Piece]:
        """The queue's piece at ``at``, and the pieces right behind it that may go in the same request
        (`KVDepotClient.submit_store_many` / `submit_retrieve_many`): same kind, stores of one
        cache salt whose requests still store, at most a piece's chunks in all (a quarter of the
        ring), and a daemon that takes several runs per request (CUDA retrieves: staged only)."""
        q = self.book.queue
        first = q[at]
        if len(q) == at + 1 or not kvreg.chains or (
                first.kind == "load" and kvreg.staging is None and kvreg.request.device == "cuda"):
            return [first]
        room = self.planner.piece_chunks(first.kind) - len(first.keys)
        out = [first]
        for p in itertools.islice(q, at + 1, at + _MAX_RUNS):
            if (p.kind != first.kind or len(p.keys) > room or not p.keys
                    or (p.kind == "store" and (p.cache_salt != first.cache_salt or p.req_id in self.book.stopped))):
                break
            out.append(p)
            room -= len(p.keys)
        return out

    def _submit(self, kvreg, batch: list[Piece], stream):
        """Send ``batch`` (`_batch`) as one request; None: no room in the staging ring now."""
        c = self.client
        if len(batch) == 1:
            p = batch[0]
            if p.kind == "store":
                return c.submit_store(kvreg, p.keys, p.block_ids, p.parent, p.cache_salt, p.req_id,
                                      after=stream, wait_for_room=False)
            return c.submit_retrieve(kvreg, p.keys, p.block_ids, p.skip_tokens, p.req_id, wait_for_room=False)
        if batch[0].kind == "store":
            return c.submit_store_many(kvreg, [StoreItem(p.keys, p.block_ids, p.parent) for p in batch],
                                       batch[0].cache_salt, after=stream, wait_for_room=False)
        return c.submit_retrieve_many(kvreg, [RetrieveItem(p.keys, p.block_ids, p.skip_tokens) for p in batch],
                                      wait_for_room=False)


def _hold_s(op: Op, default_s: float) -> float:
    """How long to wait for an unstaged store's reply before its blocks are reused: until its
    deadline passed with margin (`PendingStore.blocks_free_at_s`), else ``default_s``."""
    free_at = op.pending.blocks_free_at_s
    return default_s if free_at is None else max(0.0, free_at - time.monotonic())

