"""What the worker's transfer thread (`kvdepot.client.vllm.mover`) keeps per transfer, and
what it hands the engine thread: pieces of store / load jobs, load jobs in flight, requests
sent (`Book`: the queue, the ops in flight, stopped requests), how loads ended, preemptions and
results."""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import weakref

import torch

from kvdepot.client.pending import PendingRetrieve, PendingStore
from kvdepot.client.vllm.plan import LoadJob

log = logging.getLogger("kvdepot.vllm")


@dataclasses.dataclass(slots=True)
class Piece:
    """Up to a quarter of the staging ring of one store or load job."""

    req_id: str
    kind: str  # "store" / "load"
    keys: list[bytes]  # this shard's keys
    block_ids: list[list[int]]  # per daemon gid, registered (kernel) block ids
    parent: bytes = b""  # store: key of the chunk before
    cache_salt: str = ""
    skip_tokens: int = 0  # load
    load: Load | None = None  # load: the job it belongs to
    index: int = 0  # load: piece number within the job
    queued_at: float = 0.0
    waited: bool = False  # found the staging ring full at least once (counted in pieces_queued)
    after: object = None  # CUDA: the engine-stream event the gather / scatter must follow


class PostedSave:
    """A sliding-window model's "save" (CUDA), posted by ``wait_for_save`` with the engine's
    stream: whichever of the transfer thread (when it takes the command) and the engine thread
    (``bind_connector_metadata``, before a forward that may write one of its blocks) claims it first gathers its
    stores on that stream (`kvdepot.client.vllm.sender.Sender.stage_saves`), so that every forward enqueued after the
    claim follows the gathers. The claimant holds ``lock`` while it gathers: the other side
    blocks on it (the thread) or sees it held and waits for the thread (``bind_connector_metadata``).

    ``staged``: what the claimant's `stage_saves` returned (None: not staged, no fence words or
    another daemon generation); ``event``: then, an event on the engine's stream for the
    thread's own gathers to follow (``bind_connector_metadata`` claimed it), or None (the thread records one)."""

    __slots__ = ("stream", "lock", "owner", "staged", "event")

    def __init__(self, stream) -> None:
        self.stream = stream  # the engine's torch.cuda.Stream at wait_for_save
        self.lock = threading.Lock()
        self.owner: str | None = None  # "thread" / "engine" once claimed
        self.staged = None
        self.event = None

    def event_here(self):
        """Record ``event`` on the engine's stream now and return it: without fence words the
        thread gathers on its side stream after this point."""
        self.event = torch.cuda.Event()
        self.event.record(self.stream)
        return self.event

    def claim(self, who: str, blocking: bool) -> bool:
        """Take the lock; True (lock held: gather, then release it) if nobody claimed the save
        yet, else False with the lock not held. ``blocking=False``: False at once while the
        other side holds the lock."""
        if not self.lock.acquire(blocking):
            return False
        if self.owner is not None:
            self.lock.release()
            return False
        self.owner = who
        return True


@dataclasses.dataclass(slots=True)
class Load:
    """A load job in flight: reported once every piece ended."""

    job: LoadJob
    retrieved: list[int | None]  # per piece: chunks written (None: not ended yet)
    chunks: list[int]  # per piece: chunks asked for


@dataclasses.dataclass(slots=True)
class Op:
    piece: Piece
    pending: PendingStore | PendingRetrieve
    generation: int  # the client's boot generation when sent
    sent_at: float
    late: bool = False  # rpc_timeout_s passed (logged, daemon marked down)
    run: int = -1  # sent with other pieces in one request (`TransferThread._batch`): its run there


class Preemption:
    """A `TransferThread.preempt` in progress: ``done`` is set once the thread dropped the
    requests' queued stores; ``event`` (CUDA) follows every gather the thread queued before."""

    __slots__ = ("req_ids", "done", "event")

    def __init__(self, req_ids: set[str]) -> None:
        self.req_ids = req_ids
        self.done = threading.Event()
        self.event = None


@dataclasses.dataclass(slots=True)
class Results:
    """What the transfer thread reports to the engine thread (taken by `WorkerConnector.get_transfer_results`)."""

    sending: set[str] = dataclasses.field(default_factory=set)  # finished requests whose transfers ended
    recving: set[str] = dataclasses.field(default_factory=set)  # loads that ended (ok or not)
    failed_recving: set[str] = dataclasses.field(default_factory=set)
    invalid_blocks: set[int] = dataclasses.field(default_factory=set)
    scatter_event: object = None  # CUDA: recorded after the scatters of every load in ``recving``
    saves_ended: set[int] = dataclasses.field(default_factory=set)  # pinned saves ended (`KVDepotWorkerMeta`)
    # vLLM's ``KVConnectorTransferResults`` over the same three sets (so a merge into them,
    # `TransferThread.merge_rest`, is in it too): built by the transfer thread when it publishes,
    # what the engine thread's ``get_transfer_results`` returns (one object less to build on
    # the step: 4-5 us of cold caches on an H200 host)
    transfer: object = None


class LoadOutcomes:
    """How the loads of a worker ended, until the transfer thread publishes them: requests in
    ``finished_recving``, those that failed (hybrid models: vLLM takes failures per request) and
    single-group models' blocks not loaded (vLLM's invalid blocks, recomputed).

    Args:
        side: the `WorkerConnector` (its stats, groups and configuration).
    """

    def __init__(self, side) -> None:
        self.side = side
        self.recving: set[str] = set()
        self.failed_recving: set[str] = set()
        self.invalid_blocks: set[int] = set()

    def piece_ended(self, p: Piece, retrieved: int) -> None:
        """One piece of a load ended with ``retrieved`` chunks written; the load ends with its last."""
        load = p.load
        if load.retrieved[p.index] is not None:
            return
        load.retrieved[p.index] = retrieved
        if any(r is None for r in load.retrieved):
            return  # other pieces still run or wait
        total = 0
        for got, asked in zip(load.retrieved, load.chunks):
            total += got
            if got < asked:
                break
        self.finish(load.job, total)

    def finish(self, job: LoadJob, retrieved: int) -> None:
        """The load of ``job`` ended with its first ``retrieved`` chunks written."""
        side = self.side
        c = side.cfg.chunk_size
        side.stats["loaded_chunks"] += retrieved
        loaded_end = (job.first_chunk + retrieved) * c if retrieved else job.local_tokens
        if loaded_end < job.end_tokens:
            side.stats["load_failures"] += 1
            self._fail(job, max(loaded_end, job.local_tokens))
        self.recving.add(job.req_id)

    def _fail(self, job: LoadJob, valid_end: int) -> None:
        """Report tokens ``[valid_end, job.end_tokens)`` as not loaded."""
        side = self.side
        if side.single_group:
            g = side.groups[0]
            ids = job.fail_block_ids[0] if job.fail_block_ids else []
            first_block = job.local_tokens // g.block_size
            start = valid_end // g.block_size - first_block
            self.invalid_blocks.update(ids[max(start, 0):])
            if not ids:
                self.failed_recving.add(job.req_id)
        else:
            self.failed_recving.add(job.req_id)  # hybrid: vLLM takes failures per request only


class Book:
    """The transfer thread's pieces: ``queue`` (waiting for ring room, in order), ``ops`` (sent,
    not ended), ``stopped`` (requests whose later stores are skipped: a chunk was) and ``loads``
    (how loads ended, until published).

    Args:
        loads: the worker's `LoadOutcomes`.
        stats: the worker's counters (``store_failures``).
    """

    def __init__(self, loads: LoadOutcomes, stats: dict) -> None:
        self.queue: collections.deque[Piece] = collections.deque()
        self.ops: list[Op] = []
        self.stopped: set[str] = set()
        self.loads = loads
        self.stats = stats

    def take(self, at: int) -> Piece:
        """Remove and return the queue's piece at index ``at``."""
        q = self.queue
        if at == 0:
            return q.popleft()
        p = q[at]
        del q[at]
        return p

    def drop(self, p: Piece, why: str) -> None:
        """``p`` will not be sent: a store is counted failed and its request stopped, a load's
        piece ends with nothing loaded (recomputed)."""
        if p.kind == "store":
            self.stats["store_failures"] += 1
            self.stopped.add(p.req_id)
            log.debug("kvdepot: store of request %s skipped: %s", p.req_id, why)
        else:
            self.loads.piece_ended(p, 0)

    def live_piece_ids(self) -> set[int]:
        """``id`` of every piece in flight or queued."""
        return {id(op.piece) for op in self.ops} | {id(p) for p in self.queue}

    def busy(self, req_id: str) -> bool:
        """Whether a piece of ``req_id`` is in flight or queued."""
        return any(op.piece.req_id == req_id for op in self.ops) or any(p.req_id == req_id for p in self.queue)


__all__ = ["Piece", "Load", "LoadOutcomes", "Op", "Preemption", "Results", "PinnedSaves", "Wake", "Book"]


class PinnedSaves:
    """A worker's pinned saves not reported yet (`KVDepotMetadata.pin_seq`: the scheduler holds
    the sliding-window blocks they read until every worker reported them ended), on the
    transfer thread.

    A save ends once none of its pieces is in flight or queued any more (answered, skipped or
    given up) and a side-stream event recorded after that ran: a piece given up may have had
    its gather queued already (an answered one's ran before the daemon's copy).
    """

    def __init__(self) -> None:
        self._saves: dict[int, list] = {}  # seq -> [its pieces still to end, the event once they all had]

    def __bool__(self) -> bool:
        return bool(self._saves)

    def add(self, seq: int, pieces: list[Piece]) -> None:
        self._saves[seq] = [pieces, None]

    def abandon(self) -> None:
        """Nothing of any of them will be sent any more (the thread failed): each ends once the
        gathers queued before now ran."""
        for entry in self._saves.values():
            if entry[1] is None:
                entry[0] = ()

    def ended(self, live_ids, side_stream) -> set[int]:
        """The saves that ended since the last call; ``live_ids()``: the ``id`` of every piece
        in flight or queued; ``side_stream``: the stream of the thread's gathers (None: CPU)."""
        out: set[int] = set()
        live = None
        for seq, entry in list(self._saves.items()):
            pieces, ev = entry
            if ev is None:
                if pieces:
                    if live is None:
                        live = live_ids()
                    if any(id(p) in live for p in pieces):
                        continue
                if side_stream is None:
                    out.add(seq)
                    del self._saves[seq]
                    continue
                ev = torch.cuda.Event()
                ev.record(side_stream)
                entry[:] = [(), ev]
            if ev.query():
                out.add(seq)
                del self._saves[seq]
        return out


class Wake:
    """An eventfd by which the engine thread cuts short the transfer thread's wait for replies
    (`Connection.poll` with ``wake_fd``). The thread sets ``waiting`` before its last look
    at its inbox and clears it after the wait, so a command put while it is set is either seen
    by that look or signalled; a command put after needs no signal."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        # closed by `close`, else when the object goes (a transfer thread dropped unstopped)
        self._close = weakref.finalize(self, os.close, self.fd)
        self.waiting = False
        self._signalled = False  # set after a write: `drain` reads only then (no syscall per wait)

    def signal(self) -> None:
        """Engine thread: end the thread's wait, if it is in one."""
        if self.waiting:
            os.eventfd_write(self.fd, 1)
            self._signalled = True  # after the write: a drain that sees it reads the count

    def drain(self) -> None:
        """Transfer thread, after its wait: reset a signal (one that came too late leaves a
        count behind, which would end the next wait at once)."""
        if self._signalled:
            self._signalled = False
            try:
                os.eventfd_read(self.fd)
            except BlockingIOError:
                pass

    def close(self) -> None:
        """Close the eventfd (once; later calls do nothing)."""
        self._close()
