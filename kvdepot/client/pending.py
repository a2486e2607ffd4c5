"""Handles of submitted STORE / RETRIEVE requests (`KVDepotClient.submit_store`,
`KVDepotClient.submit_retrieve`): ``done()`` never blocks, ``result()`` waits for the reply
and, with engine-side staging, frees or scatters out of the request's staging-ring region."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

if TYPE_CHECKING:
    from kvdepot.client.client import KVDepotClient, Registration


def region_reusable_after(error: KVDepotError) -> bool:
    """Whether a failed staged request's ring region may be reused: not when the request was
    lost in a timeout or with the connection (the daemon may still copy into or out of it)."""
    return error.code not in (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED)


class PendingStore:
    """A submitted STORE (`KVDepotClient.submit_store`)."""

    _LEARN_BYTES = 4 << 20  # staged stores at least this large teach the client the link's pace
    _SPIN_LEAD_S = 30e-6  # spin from this long before the fastest reply seen could come

    def __init__(self, client: KVDepotClient, rid: int, region=None, num_chunks: int = 0) -> None:
        self.client, self.rid = client, rid
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
            c = self.client
            spin_from = 0.0
            if self._region is not None and c._staged_store_s_per_byte is not None:
                spin_from = self._sent_at + self._region.size_bytes * c._staged_store_s_per_byte - self._SPIN_LEAD_S
            try:
                self._reply = c.wait(self.rid, timeout_s, spin_from)
            except KVDepotError as exc:
                self._error = exc
            else:
                if (self._region is not None and self._region.size_bytes >= self._LEARN_BYTES
                        and self._reply.stored == self._num_chunks):
                    pace = (time.monotonic() - self._sent_at) / self._region.size_bytes
                    if c._staged_store_s_per_byte is None or pace < c._staged_store_s_per_byte:
                        c._staged_store_s_per_byte = pace
        if self._error is not None:
            raise self._error
        return self._reply

    def _region_free(self) -> bool:
        if self._reply is None and self._error is None and self.client.done(self.rid):
            try:  # the reply is in (collected by a poll): take it, without waiting
                self._await(0)
            except KVDepotError:
                pass
        if self._error is not None:
            return region_reusable_after(self._error)
        return self._reply is not None

    def _reclaim(self) -> bool:
        try:
            self._await()
        except KVDepotError:
            pass
        return self._region_free()

    def result(self, before=None, timeout_s: float | None = None, cpu_wait: bool = False,
               in_l1: bool = False) -> m.StoreReply:
        """Wait for the reply; with an early reply, ``before`` (a ``torch.cuda.Stream``) is made
        to wait until the daemon has read the blocks, or with ``cpu_wait`` this call waits for
        that (``in_l1``: until the bytes are in L1). With engine-side staging the blocks were
        read on the stream given to `submit_store` and the reply comes once the bytes are in
        L1, so nothing more is waited for. Raises KVDepotError as `KVDepotClient.store`."""
        r = self._await(timeout_s)
        if r.event and cpu_wait:  # (a staged store's reply carries no event)
            ev = r.stored_event if in_l1 and r.stored_event else r.event
            self.client._open_event(ev, before.device if before is not None else None).synchronize()
        elif r.event and before is not None:
            before.wait_event(self.client._open_event(r.event, before.device))
        return r


class PendingRetrieve:
    """A submitted RETRIEVE (`KVDepotClient.submit_retrieve`)."""

    def __init__(self, client: KVDepotClient, rid: int) -> None:
        self.client, self.rid = client, rid
        self._region = None
        self._retrieved: int | None = None
        self._error: BaseException | None = None
        self._done_event = None  # staged: local event after the scatter
        self._reply: m.RetrieveReply | None = None  # staged: the reply, once taken by done()

    def done(self) -> bool:
        """Whether `result` returns without waiting on the daemon: its reply (or error, or loss)
        is in and, staged, the daemon's copies into the ring have completed (the event is
        queried, never waited for). Call the client's `poll` first to collect replies."""
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
        ev = self._reply.event
        if not (self._reply.retrieved and ev):
            return True
        return self.client._open_event(ev, self._reg.staging.device).query()

    def _staged(self, reg: Registration, region, block_ids, num_chunks: int, skip_tokens: int) -> None:
        self._reg, self._region, self._block_ids = reg, region, block_ids
        self._num_chunks, self._skip_tokens = num_chunks, skip_tokens
        region.is_free = self._region_free
        region.reclaim = self._reclaim

    def _region_free(self) -> bool:
        if self._error is not None:
            return region_reusable_after(self._error)
        if self._retrieved is None:
            return False
        return self._done_event is None or self._done_event.query()

    def _reclaim(self) -> bool:
        if self._retrieved is None and self._error is None:
            try:
                self.result()  # scatters on the current stream; a later result(before) orders after it
            except KVDepotError:
                pass
        if self._done_event is not None:
            self._done_event.synchronize()
        return self._region_free()

    def result(self, before=None, timeout_s: float | None = None, cpu_wait: bool = False) -> int:
        """Chunks written; ``before`` (a ``torch.cuda.Stream``) is made to wait for them, or with
        ``cpu_wait`` this call waits until they are written. With engine-side staging this call
        waits on the CPU for the daemon's copies into the ring (whatever ``cpu_wait`` says),
        then enqueues the scatter on ``before`` (default: the current stream): the blocks are
        written in that stream's order (work queued on it later reads them; another stream or
        the host waits on ``last_retrieve_event``, a local event after the scatter). Raises
        KVDepotError as `KVDepotClient.retrieve`."""
        if self._region is None:
            if self._error is not None:
                raise self._error
            try:
                r = self.client.wait(self.rid, timeout_s)
            except KVDepotError as exc:
                self._error = exc
                raise
            return self.client._retrieved(r, before, cpu_wait)
        if self._retrieved is not None:  # already scattered (by a ring reclaim): order `before` after it
            if before is not None and self._done_event is not None:
                before.wait_event(self._done_event)
            self.client.last_retrieve_event = self._done_event
            return self._retrieved
        if self._error is not None:
            raise self._error
        import torch

        r = self._reply
        if r is None:
            try:
                r = self.client.wait(self.rid, timeout_s)
            except KVDepotError as exc:
                self._error = exc
                raise
        staging = self._reg.staging
        stream = before if before is not None else torch.cuda.current_stream(staging.device)
        if r.retrieved and r.event:
            # on the CPU whatever cpu_wait says: with stores and retrieves in flight together, an
            # engine stream's GPU wait on the daemon's event held both directions to 65-79 GB/s
            # (H100 and H200, 256-token chunks), against 88-99 GB/s waiting here; the wait only
            # covers this retrieve's copies (the daemon's events rotate, RETRIEVE_EVENTS)
            self.client._open_event(r.event, stream.device).synchronize()
        if r.retrieved:
            staging.scatter(self._block_ids, self._num_chunks, r.retrieved, self._region.offset,
                            self._skip_tokens, stream)
            done = torch.cuda.Event()
            done.record(stream)
            self._done_event = done
        self._retrieved = r.retrieved
        self.client.last_retrieve_event = self._done_event
        return r.retrieved
