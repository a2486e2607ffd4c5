"""Handles of submitted STORE / RETRIEVE requests (`KVDepotClient.submit_store`,
`KVDepotClient.submit_retrieve`): ``done()`` never blocks, ``result()`` waits for the reply
and, with engine-side staging, frees or scatters out of the request's staging-ring region; a
region whose request was lost in a timeout is settled by a `Drain` (`Drains`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Protocol

import zmq

from kvdepot import trace
from kvdepot.client.many import masked_block_ids
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

if TYPE_CHECKING:
    from kvdepot.client.registration import Registration

log = logging.getLogger("kvdepot.client")
LANDED_GRACE_S = 0.05  # how long a gated retrieve's landed word may lag behind its reply
# an unstaged store's blocks are the engine's again this long after its deadline
# (`Store.deadline_ns`): the daemon begins no copy after it and commits no store whose copies
# ended after it, so a copy still reading the blocks then can never publish what it read
DEADLINE_MARGIN_S = 1.0


def region_reusable_after(error: KVDepotError) -> bool:
    """Whether a failed staged request's ring region may be reused: not when the request was
    lost in a timeout or with the connection (the daemon may still copy into or out of it)."""
    return error.code not in (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED)


class Drains:
    """The `Drain` requests of one client that settle staging regions lost in a timeout: at
    most one in flight per ring (``{id(ring): (rid, through_seq)}``), and how many were
    answered. Used only from the client's own thread."""

    __slots__ = ("_inflight", "answered")

    def __init__(self) -> None:
        self._inflight: dict[int, tuple[int, int]] = {}
        self.answered = 0

    def settles(self, client: RequestChannel, reg: Registration, seq: int) -> bool:
        """Whether staging region ``seq`` of ``reg``, whose request was lost in a timeout, may
        be reused: a `Drain` through it was answered (the daemon finished every copy of it and
        refuses the request should it still arrive). Never blocks: sends one Drain per ring at a
        time (only from ``client``'s own thread) and takes its reply in a later call. The Drain
        goes through ``seq`` only, not through the ring's newest region: another client sharing
        the ring may have regions after it whose requests are still on their way."""
        ring = reg.staging.ring
        if ring.drained_through >= seq:
            return True
        if not client.on_own_thread():
            return False  # another client's thread asks: this client's socket is not its to use
        got = self._inflight.get(id(ring))
        if got is not None:
            rid, through = got
            client.poll()
            if not client.done(rid):
                return False
            del self._inflight[id(ring)]
            try:
                client.wait(rid, 0)
            except KVDepotError:
                return False  # lost or refused: the next call asks again
            ring.drained_through = max(ring.drained_through, through)
            self.answered += 1
            return ring.drained_through >= seq
        try:
            rid = client.submit(m.Drain(rid=0, registration=reg.id, through_seq=seq))
        except (KVDepotError, OSError, zmq.ZMQError):
            return False
        self._inflight[id(ring)] = (rid, seq)
        return False


class ScatterNote:
    """The last staged retrieve's scatter, whose ``result`` ran, of one client: a
    ``torch.cuda.Event`` after it, or the stream it was enqueued on (fence words: no event is
    recorded unless asked for, `event`), or neither (it wrote nothing)."""

    __slots__ = ("_event", "_stream")

    def __init__(self) -> None:
        self._event = None
        self._stream = None

    def set(self, event, stream) -> None:
        self._event, self._stream = event, stream

    def event(self):
        """The event after the last scatter (recorded now, on its stream, if none was: it
        then covers whatever that stream had before this call too); None if it wrote nothing."""
        if self._event is None and self._stream is not None:
            import torch

            self._event = torch.cuda.Event()
            self._event.record(self._stream)
            self._stream = None
        return self._event

    @property
    def stream(self):
        """The stream of the last scatter while no event was recorded for it, else None."""
        return self._stream


class RequestChannel(Protocol):
    """What a pending handle uses of its client (`kvdepot.client.KVDepotClient` is one): the
    reply of its request, the pace of earlier replies, and the client's drains and scatter note."""

    timeout_s: float
    store_pace: LinkPace
    retrieve_pace: LinkPace
    drains: Drains
    last_scatter: ScatterNote

    def done(self, rid: int) -> bool: ...

    def wait(self, rid: int, timeout_s: float | None = None, spin_from: float = 0.0, until=None) -> m.Msg: ...

    def poll(self, timeout_s: float = 0.0, wake_fd: int | None = None) -> None: ...

    def submit(self, req: m.Msg, on_reply=None) -> int: ...

    def forget(self, rid: int) -> None: ...

    def on_own_thread(self) -> bool: ...

    def confirm_later(self, rid: int) -> None: ...


def _settle_lost(pending) -> bool:
    """``pending._region_free()``, waiting up to the client's timeout for the `Drain` that
    settles a region lost in a timeout (a blocking reclaim may wait; `_region_free` never does)."""
    free = pending._region_free()
    err = pending._error
    if free or err is None or err.code != ErrorCode.TIMEOUT:
        return free
    deadline = time.monotonic() + pending.client.timeout_s
    while not free and time.monotonic() < deadline:
        pending.client.poll(0.002)
        free = pending._region_free()
    return free


class LinkPace:
    """The fastest staged request of one direction a client has seen, submit to reply, in
    seconds per byte (requests of at least ``LEARN_BYTES``): a wait for such a reply sleeps
    until shortly before it could come, then spins (`Connection.wait`'s ``spin_from``), so
    a lone request is not answered into a blocked ``poll`` (tens of microseconds to wake)."""

    LEARN_BYTES = 4 << 20
    SPIN_LEAD_S = 30e-6  # spin from this long before the fastest reply seen could come

    __slots__ = ("s_per_byte",)

    def __init__(self) -> None:
        self.s_per_byte: float | None = None

    def spin_from(self, sent_at: float, size_bytes: int) -> float:
        """``time.monotonic()`` seconds from which to spin for a request of ``size_bytes`` sent
        at ``sent_at`` (0.0: nothing learnt yet, spin at once)."""
        if self.s_per_byte is None:
            return 0.0
        return sent_at + size_bytes * self.s_per_byte - self.SPIN_LEAD_S

    def learn(self, sent_at: float, size_bytes: int) -> None:
        """A whole request of ``size_bytes`` sent at ``sent_at`` was answered just now."""
        if size_bytes >= self.LEARN_BYTES:
            pace = (time.monotonic() - sent_at) / size_bytes
            if self.s_per_byte is None or pace < self.s_per_byte:
                self.s_per_byte = pace


class PendingStore:
    """A submitted STORE (`KVDepotClient.submit_store`)."""

    def __init__(self, client: RequestChannel, rid: int, region=None, num_chunks: int = 0, fence=None,
                 reg: Registration | None = None, landed: bool = False, deadline_ns: int = 0) -> None:
        self.client, self.rid = client, rid
        # unstaged with a deadline: ``time.monotonic()`` after which the daemon never touches the
        # blocks, whatever became of the request (None: only its reply or the daemon's restart says)
        self.blocks_free_at_s = deadline_ns / 1e9 + DEADLINE_MARGIN_S if deadline_ns else None
        self._reg = reg
        self._landed = landed  # sent with `Store.landed`: `result` may end on the region's word
        # fenced (`kvdepot.client.staging.FenceWords`): the region is free only once its gather
        # ran too (after a failed store the daemon copied nothing, but the gather may be queued)
        self._fence = fence
        self._reply: m.StoreReply | None = None
        self._error: BaseException | None = None
        # staged: the ring region the daemon copies out of; its reply comes after the copies
        self._region = region
        self._num_chunks = num_chunks
        self._sent_at = time.monotonic()
        if region is not None:
            region.is_free = self._region_free
            region.reclaim = self._reclaim

    def done(self) -> bool:
        """Whether `result` returns at once (reply, error or loss in); never blocks (call the
        client's `poll` first to collect replies)."""
        return self._reply is not None or self._error is not None or self.client.done(self.rid)

    def _await(self, timeout_s: float | None = None) -> m.StoreReply:
        if self._reply is None and self._error is None:
            region, pace = self._region, self.client.store_pace
            spin_from = pace.spin_from(self._sent_at, region.size_bytes) if region is not None else 0.0
            until = None
            if self._landed and timeout_s != 0:
                fence, seq = self._fence, region.seq
                until = lambda: fence.landed(seq)  # noqa: E731 - the daemon wrote `stored_value`
            try:
                self._reply = self.client.wait(self.rid, timeout_s, spin_from, until=until)
            except KVDepotError as exc:
                self._error = exc
            else:
                if self._reply is None:  # every chunk is in L1: the reply follows the daemon's commit
                    trace.point(self.rid, "c_landed")
                    self._reply = m.StoreReply(rid=self.rid, stored=self._num_chunks, present=0, skipped=0)
                    self.client.confirm_later(self.rid)
                if region is not None and self._reply.stored == self._num_chunks:
                    pace.learn(self._sent_at, region.size_bytes)
        if self._error is not None:
            raise self._error
        return self._reply

    def _region_free(self) -> bool:
        # another client's thread (sharing the ring) may ask: only this client's thread takes the reply
        if (self._reply is None and self._error is None and self.client.on_own_thread()
                and self.client.done(self.rid)):
            try:  # the reply is in (collected by a poll): take it, without waiting
                self._await(0)
            except KVDepotError:
                pass
        if self._error is not None:
            free = region_reusable_after(self._error) or self._settled(self._error)
        else:
            free = self._reply is not None
        return free and (self._fence is None or self._fence.holds(self._region.seq))

    def _settled(self, error: KVDepotError) -> bool:
        return (error.code == ErrorCode.TIMEOUT and self._reg is not None
                and self.client.drains.settles(self.client, self._reg, self._region.seq))

    def _reclaim(self) -> bool:
        try:
            self._await()
        except KVDepotError:
            pass
        if self._fence is not None and not self._fence.holds(self._region.seq):
            deadline = time.monotonic() + self.client.timeout_s
            while not self._fence.holds(self._region.seq) and time.monotonic() < deadline:
                time.sleep(20e-6)  # only after an error reply: the gather has not run yet
        return _settle_lost(self)

    def result(self, before=None, timeout_s: float | None = None, cpu_wait: bool = False,
               in_l1: bool = False) -> m.StoreReply:
        """Wait for the reply: it comes once the chunks are in the daemon's L1 (or were
        skipped). ``before``, ``cpu_wait``, ``in_l1``: ignored (kept for callers of the early
        replies the daemon no longer gives). Raises KVDepotError as `KVDepotClient.store`."""
        return self._await(timeout_s)


def gate_scatter(reg: Registration, region, block_ids, num_chunks: int, skip_tokens: int, stream) -> bool:
    """Once a staged retrieve with `Retrieve.landed` was sent (its region's word cleared first,
    `FenceWords.close_gate`): enqueue its scatter on ``stream`` behind the landed word
    (`EngineStaging.scatter_gated`). False (the word opened, nothing left waiting) if the
    library refuses: `PendingRetrieve.result` then scatters after the reply."""
    from kvdepot.gpu.kernels import KernelError

    staging, seq = reg.staging, region.seq
    try:
        staging.scatter_gated(block_ids, num_chunks, region.offset, skip_tokens, stream, seq)
    except KernelError as exc:
        log.warning("gated scatter refused (%s): scattering after the reply", exc)
        staging.fence.open_gate(seq)  # its wait may be enqueued
        return False
    return True


class PendingRetrieve:
    """A submitted RETRIEVE (`KVDepotClient.submit_retrieve`)."""

    def __init__(self, client: RequestChannel, rid: int) -> None:
        self.client, self.rid = client, rid
        # never set: a retrieve's deadline (`Retrieve.deadline_ns`) keeps the daemon from
        # beginning late copies, but a copy begun before it may still be writing the blocks if
        # the daemon's process was stopped in the middle of it; only the reply, a `Settle`, the
        # daemon's restart or a long hold free them
        self.blocks_free_at_s: float | None = None
        self._sent_at = time.monotonic()
        self._region = None
        self._retrieved: int | None = None
        self._error: BaseException | None = None
        self._done_event = None  # staged, no fence words: a local event after the scatter
        self._done_seq: int | None = None  # staged with fence words: its word holds this once the scatter ran
        self._scatter_stream = None  # the stream the scatter was enqueued on
        self._reply: m.RetrieveReply | None = None  # staged: the reply, once taken by done()
        self._chains = ()  # staged with `Retrieve.chains`: the runs (the scatter masks what was not found)
        self._gated = False  # its scatter was enqueued at submit, behind the landed word (`gate_scatter`)
        # with `Retrieve.chains`: each run's leading chunks written, once `result` returned
        self.chains_retrieved: list[int] = []

    def done(self) -> bool:
        """Whether `result` returns without waiting on the daemon: its reply (or error, or loss)
        is in (the daemon replies once its copies completed). Call the client's `poll` first
        to collect replies."""
        if self._retrieved is not None or self._error is not None:
            return True
        if not self.client.done(self.rid):
            return False
        if self._region is None:
            return True
        if self._reply is None:
            try:
                self._reply = self.client.wait(self.rid, 0)
            except KVDepotError as exc:
                self._error = exc
        return True

    def _staged(self, reg: Registration, region, block_ids, num_chunks: int, skip_tokens: int,
                chains=()) -> None:
        self._reg, self._region, self._block_ids = reg, region, block_ids
        self._num_chunks, self._skip_tokens, self._chains = num_chunks, skip_tokens, chains
        region.is_free = self._region_free
        region.reclaim = self._reclaim

    def _gated_on(self, stream) -> None:
        """Its scatter was enqueued on ``stream`` before the request was sent (`gate_scatter`)."""
        self._gated = True
        self._scatter_stream = stream
        self._done_seq = self._region.seq
        self._region.fenced = True  # a ring reset keeps it until the scatter ran
        self._region.gated = True  # (and opens its gate: the daemon that would write it is gone)

    def _region_free(self) -> bool:
        if (self._error is None and self._retrieved is None and self._reply is None
                and self.client.on_own_thread()):
            self.done()  # takes the reply, or the error of a request lost in a timeout
        if self._gated and self._error is not None:  # its scatter must run (writing nothing) first
            self._settle_gate()
            if not self._done_event.query():
                return False
        if self._error is not None:
            return region_reusable_after(self._error) or (
                self._error.code == ErrorCode.TIMEOUT and self.client.drains.settles(self.client, self._reg, self._region.seq))
        if self._retrieved is None:
            return False
        if self._done_seq is not None:
            return self._reg.staging.fence.holds(self._done_seq)
        return self._done_event is None or self._done_event.query()

    def _reclaim(self) -> bool:
        if self._retrieved is None and self._error is None:
            try:
                self.result()  # scatters on the current stream; a later result(before) orders after it
            except KVDepotError:
                pass
        if self._gated and self._error is not None:
            self._settle_gate()
            self._done_event.synchronize()
        elif self._done_seq is not None:
            from kvdepot.client.staging import await_word

            await_word(self._reg.staging.fence, self._done_seq, float("inf"))
        elif self._done_event is not None:
            self._done_event.synchronize()
        return _settle_lost(self)

    def _settle_gate(self) -> None:
        """A gated retrieve that failed (error, timeout, lost): open its gate, and mark the
        scatter's end with an event. A copy of a request lost in a timeout may still land and
        write the landed word after the scatter's own done value, so the region frees by that
        event (and, after a timeout, a `Drain`), not by the word."""
        self._reg.staging.fence.open_gate(self._done_seq)
        if self._done_event is None:
            import torch

            self._done_event = torch.cuda.Event()
            self._done_event.record(self._scatter_stream)

    def _gated_result(self, before, timeout_s: float | None) -> int:
        """`result` of a retrieve whose scatter was enqueued at submit (`gate_scatter`): the reply says
        how many chunks; the landed word (the daemon's, or this process's for a retrieve that
        copied nothing) lets the scatter run."""
        from kvdepot.client.staging import await_word

        fence = self._reg.staging.fence
        if self._retrieved is None and self._error is None:
            r = self._reply
            seq = self._done_seq
            if r is None:
                # the landed word carries the count as soon as the bytes are in the ring; the
                # reply (its commit and hop back, tens of microseconds later) is then dropped
                pace = self.client.retrieve_pace
                try:
                    r = self.client.wait(self.rid, timeout_s, pace.spin_from(self._sent_at, self._region.size_bytes),
                                         until=lambda: fence.landed(seq))
                except KVDepotError as exc:
                    self._error = exc
                else:
                    if r is None:  # landed
                        trace.point(self.rid, "c_landed")
                        self.client.forget(self.rid)
                        self._retrieved = fence.landed_count(seq)
                        if self._retrieved == self._num_chunks:
                            pace.learn(self._sent_at, self._region.size_bytes)
                    elif r.retrieved == self._num_chunks:
                        pace.learn(self._sent_at, self._region.size_bytes)
            if r is not None and self._error is None:
                if r.retrieved * self._reg.staging.layout.chunk_size <= self._skip_tokens:
                    fence.open_gate(self._done_seq)  # nothing copied: the daemon wrote no word
                elif not await_word(fence, self._done_seq, LANDED_GRACE_S, fence.landed):
                    # the reply comes after the word's write: never seen so far; fail it rather
                    # than report chunks the scatter may not have written
                    self._error = KVDepotError(ErrorCode.INTERNAL, f"retrieve {self.rid}: the daemon replied but "
                                                                   "its landed word never came")
                if self._error is None:
                    self.chains_retrieved = list(r.chains)
                    self._retrieved = r.retrieved
        if self._error is not None:
            self._settle_gate()  # the scatter writes nothing (or what a late copy landed)
            raise self._error
        if before is not None and before is not self._scatter_stream:
            before.wait_event(self._event())
        self.client.last_scatter.set(self._done_event, self._scatter_stream)
        return self._retrieved

    def _event(self):
        """The event after the scatter: the one recorded with it, or (fence words) one recorded
        now on the scatter's stream (it covers the scatter); None if nothing was scattered."""
        if self._done_event is None and self._scatter_stream is not None:
            import torch

            self._done_event = torch.cuda.Event()
            self._done_event.record(self._scatter_stream)
        return self._done_event

    def result(self, before=None, timeout_s: float | None = None, cpu_wait: bool = False) -> int:
        """Chunks written. Unstaged, the reply comes once the daemon wrote the blocks. With
        engine-side staging this call waits for the reply (the daemon's copies into the ring
        completed), then enqueues the scatter on ``before`` (default: the current stream): the blocks are
        written in that stream's order (work queued on it later reads them; another stream or
        the host waits on ``last_retrieve_event``, an event after the scatter). Raises
        KVDepotError as `KVDepotClient.retrieve`."""
        if self._region is None:
            if self._error is not None:
                raise self._error
            if self._retrieved is None:  # (a batch's runs may each ask: the reply is taken once)
                try:
                    r = self.client.wait(self.rid, timeout_s)
                except KVDepotError as exc:
                    self._error = exc
                    raise
                self.chains_retrieved = list(r.chains)
                self._retrieved = r.retrieved
            self.client.last_scatter.set(None, None)  # the reply comes once the blocks are written
            return self._retrieved
        if self._gated:
            return self._gated_result(before, timeout_s)
        if self._retrieved is not None:  # already scattered (by a ring reclaim): order `before` after it
            ev = self._event() if before is not None and before is not self._scatter_stream else None
            if ev is not None:
                before.wait_event(ev)
            self.client.last_scatter.set(self._done_event, self._scatter_stream)
            return self._retrieved
        if self._error is not None:
            raise self._error
        import torch

        r = self._reply
        if r is None:
            pace = self.client.retrieve_pace
            try:
                r = self.client.wait(self.rid, timeout_s, pace.spin_from(self._sent_at, self._region.size_bytes))
            except KVDepotError as exc:
                self._error = exc
                raise
            if r.retrieved == self._num_chunks:
                pace.learn(self._sent_at, self._region.size_bytes)
        staging = self._reg.staging
        stream = before if before is not None else torch.cuda.current_stream(staging.device)
        # the reply comes once the daemon's copies into the ring completed: scatter at once
        self.chains_retrieved = list(r.chains)
        if r.retrieved:
            self._scatter_stream = stream
            block_ids, upto = self._block_ids, r.retrieved
            if self._chains:  # one scatter over every run's positions, what was not found left alone
                block_ids = masked_block_ids(self._reg, block_ids, self._chains, r.chains, self._num_chunks)
                upto = self._num_chunks
            if staging.fence is not None:  # the region frees by its fence word: no event per retrieve
                staging.scatter(block_ids, self._num_chunks, upto, self._region.offset,
                                self._skip_tokens, stream, done_seq=self._region.seq)
                self._done_seq = self._region.seq
                self._region.fenced = True  # a ring reset keeps it until the scatter ran
            else:
                staging.scatter(block_ids, self._num_chunks, upto, self._region.offset,
                                self._skip_tokens, stream)
                done = torch.cuda.Event()
                done.record(stream)
                self._done_event = done
        self._retrieved = r.retrieved
        self.client.last_scatter.set(self._done_event, self._scatter_stream)
        return r.retrieved
