"""STORE and RETRIEVE (`Transfers`): the blocking calls and their ``submit_*`` forms, one
prompt's run or several (`kvdepot.client.many`), with engine-side staging
(`kvdepot.client.staging`): a store's gather sent before it runs, a retrieve's scatter gated on
the daemon's copies (`Retrieve.landed`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvdepot import trace
from kvdepot.client.connection import Connection
from kvdepot.client.many import RetrieveItem, StoreItem, check_chains, join_runs
from kvdepot.client.pending import PendingRetrieve, PendingStore, gate_scatter
from kvdepot.client.registration import Registration
from kvdepot.client.staged import Stager
from kvdepot.protocol import messages as m


class Transfers:
    """Stores and retrieves sent on ``conn``, gathered and waited for by ``stager``.

    ``copy_deadline_s``: unstaged stores and retrieves of CPU engines (the daemon copies
    straight out of or into the engine's blocks) carry a deadline this far after their send
    (`Store.deadline_ns`): their handles' ``blocks_free_at_s`` says when the blocks are the
    engine's again even if no reply ever comes. ``unstaged_requests`` counts staged
    registrations' requests that went the daemon-gathers way (no ring room)."""

    def __init__(self, conn: Connection, stager: Stager, copy_deadline_s: float) -> None:
        self.conn = conn
        self.stager = stager
        self.copy_deadline_s = copy_deadline_s
        self.unstaged_requests = 0

    def _deadline_ns(self, reg: Registration) -> int:
        """`Store.deadline_ns` of a request sent now: ``copy_deadline_s`` from now for a CPU
        engine (the daemon's copy threads read and write its shared memory); 0 for a CUDA
        engine, whose blocks stay the request's until its reply or the daemon's restart."""
        if reg.staging is not None or reg.request.device != "cpu":
            return 0
        return time.monotonic_ns() + int(self.copy_deadline_s * 1e9)

    def store(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
              parent: bytes = b"", cache_salt: str = "", request: str = "", after=None,
              early: bool = False, cpu_wait: bool = False, in_l1: bool = False) -> m.StoreReply:
        """Store whole chunks from engine blocks (see `kvdepot.protocol.messages.Store`);
        returns once the chunks are in the daemon's L1 (or were skipped). Staged with fence
        words, where the daemon writes landed words, a store whose every chunk was copied
        returns when the daemon's DMA stream wrote the region's word (`Store.landed`), before
        its commit and reply; this client's next request other than a store waits for that
        reply first, so its own lookups see the chunks.

        after: CUDA engines: the ``torch.cuda.Stream`` whose work so far wrote the blocks
            (default: the current stream). Staged, the gather is enqueued on it; the blocks may
            be overwritten by work enqueued there after this call.
        early, cpu_wait, in_l1: ignored (the daemon no longer replies early: see
            `kvdepot.protocol.messages.Store`).
        """
        return self.submit_store(reg, keys, block_ids, parent, cache_salt, request, after).result()

    def submit_store(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
                     parent: bytes = b"", cache_salt: str = "", request: str = "", after=None,
                     early: bool = False, wait_for_room: bool = True, staged=None,
                     chains: Sequence[m.Chain] = ()) -> PendingStore | None:
        """`store` without waiting: ``.result()`` of the returned handle gives the `StoreReply`.
        Unstaged, the blocks must not be overwritten before then. ``early``: ignored.

        With engine-side staging (`register`'s ``local_storages``) the blocks are gathered into
        the staging ring here (`stage_store`, on ``after``, default: the current stream), so
        work enqueued on that stream later may overwrite them at once; the store is sent without
        waiting for the gather (the daemon copies once the GPU wrote its fence word,
        `kvdepot.client.staging`). Without fence words (a daemon on tcp://, or one that does not
        poll them), and unstaged, this call waits until the GPU has run the work enqueued on
        ``after`` so far. ``wait_for_room=False``: if the ring has no room for the chunks now,
        nothing is sent and None is returned (never blocks). ``staged``: the region a
        `stage_store` of these chunks returned (nothing is gathered here; on an error the
        region is given up, `abandon_region`). ``chains``: ``keys`` / ``block_ids`` are several
        prompts' runs (`kvdepot.protocol.messages.Chain`; ``parent`` empty), see
        `submit_store_many`."""
        if chains:
            check_chains(reg, parent)
        offset = -1
        fence = 0
        region = staged
        staging = reg.staging
        gather_after_send = False
        if region is None and staging is not None and keys:
            if staging.fence_active:
                # the store goes out first and the gather is enqueued while it travels: the
                # daemon copies once the GPU wrote the region's fence word either way
                region = staging.ring.alloc(len(keys) * reg.object_bytes, self.conn, wait=wait_for_room, fenced=True)
                gather_after_send = region is not None
            else:
                region = self.stager.stage_store(reg, block_ids, len(keys), after, wait_for_room)
            if region is None:
                if not wait_for_room:
                    return None
                self.unstaged_requests += 1
        if region is None and after is not None:
            self.stager.fence(after)  # unstaged: the daemon reads the blocks once it has the request
        if region is not None:
            offset = region.offset
            fence = region.seq if region.fenced else 0
        # the daemon's DMA stream may end the store in the region's fence word (`Store.landed`)
        landed = bool(fence and not chains and staging.landed_active
                      and fence <= m.LANDED_MAX_SEQ and len(keys) <= m.LANDED_MAX_CHUNKS)
        gathered_ns = trace.now_ns()
        deadline_ns = self._deadline_ns(reg)
        try:
            rid = self.conn.submit(m.Store(rid=0, registration=reg.id, keys=list(keys),
                                      block_ids=[list(b) for b in block_ids], parent=parent, cache_salt=cache_salt,
                                      request=request, staging_offset=offset, fence=fence,
                                      staging_seq=region.seq if region is not None else 0, chains=list(chains),
                                      landed=landed, deadline_ns=deadline_ns))
        except BaseException:
            if gather_after_send:
                region.fenced = False
                region.release()  # nothing was sent nor gathered
            elif region is not None:
                self.stager.abandon_region(reg, region)  # nothing was sent: no copy reads it
            raise
        trace.point_at(rid, "c_gathered", gathered_ns)
        if gather_after_send:
            try:
                self.stager.gather(reg, region, block_ids, len(keys), after)
            except BaseException:
                # nothing of the region is pending on the GPU: the word tells the daemon to copy
                # nothing (its reply, an error, is dropped), and the region is free at once
                staging.fence.abandon(region.seq)
                self.conn.forget(rid)
                region.fenced = False
                region.release()
                raise
        return PendingStore(self.conn, rid, region, len(keys), staging.fence if fence else None, reg, landed, deadline_ns)

    def retrieve(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
                 skip_tokens: int = 0, request: str = "", before=None, cpu_wait: bool = False) -> int:
        """Write cached chunks into engine blocks; returns how many leading chunks were written.

        before: CUDA engines with engine-side staging: the ``torch.cuda.Stream`` the scatter out
            of the staging ring is enqueued on (default: the current stream); work enqueued
            there later reads the blocks, another stream waits on ``last_retrieve_event``.
            Where the daemon writes landed words (`RegisterReply.landed`) the scatter is
            enqueued as the request leaves, behind a GPU wait for the daemon's copies
            (``scatter_on`` of `submit_retrieve`), and the call returns once they landed.
            Unstaged, the call returns once the daemon wrote the blocks.
        cpu_wait: ignored (the daemon answers once its copies completed; a GPU stream's wait
            on another process's event was measured to add ~170 us to a lone 32 MiB retrieve,
            H100, no MPS, and such an event was seen to report its record complete too early).
        """
        if before is None and reg.staging is not None:
            import torch

            before = torch.cuda.current_stream(reg.staging.device)
        return self.submit_retrieve(reg, keys, block_ids, skip_tokens, request,
                                    scatter_on=before).result(before, cpu_wait=cpu_wait)

    def submit_retrieve(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
                        skip_tokens: int = 0, request: str = "", wait_for_room: bool = True,
                        chains: Sequence[m.Chain] = (), scatter_on=None) -> PendingRetrieve | None:
        """`retrieve` without waiting: ``.result(before)`` of the returned handle gives the
        number of chunks written (and makes ``before`` wait for them).

        A registration's retrieves complete in the order the daemon received them, and the
        event of a later reply covers every earlier one: with several outstanding, an engine
        may pass ``before`` only to the last ``result`` (each GPU wait on an interprocess
        event costs the waiting stream tens of microseconds). With engine-side staging each
        ``result`` enqueues its own scatter, so pass ``before`` to every one.
        ``wait_for_room=False``: if the staging ring has no room now, nothing is sent and None
        is returned. A block id of -1 leaves that block unwritten. ``chains``: several prompts'
        runs (``skip_tokens`` 0), see `submit_retrieve_many`.

        ``scatter_on`` (a ``torch.cuda.Stream``; staged, no ``chains``, a daemon that writes
        landed words: `RegisterReply.landed`): the scatter is enqueued on it now, behind a GPU
        wait for the daemon's copies into the ring (`EngineStaging.scatter_gated`), so that it
        starts as the bytes land instead of after the reply's hop back and this process's
        launch (~50 us of a lone 32 MiB retrieve on an H100). That stream then waits for the
        daemon: call ``result`` (which opens the wait itself if no reply comes within the
        timeout) before anything that must not wait is enqueued there."""
        if chains:
            check_chains(reg, skip_tokens)
        region = None
        if reg.staging is not None and keys:
            region = reg.staging.load_ring.alloc(len(keys) * reg.object_bytes, self.conn, wait=wait_for_room)
            if region is None:
                if not wait_for_room:
                    return None
                self.unstaged_requests += 1
        gated = (scatter_on is not None and region is not None and not chains and reg.staging.landed_active
                 and region.seq <= m.LANDED_MAX_SEQ and len(keys) <= m.LANDED_MAX_CHUNKS)
        if gated:  # before sending: the daemon's word may come before this thread's next line
            reg.staging.fence.close_gate(region.seq)
        deadline_ns = self._deadline_ns(reg)
        try:
            rid = self.conn.submit(m.Retrieve(rid=0, registration=reg.id, keys=list(keys),
                                         block_ids=[list(b) for b in block_ids], skip_tokens=skip_tokens,
                                         request=request, staging_offset=region.offset if region else -1,
                                         staging_seq=region.seq if region else 0, chains=list(chains),
                                         landed=gated, deadline_ns=deadline_ns))
        except BaseException:
            if region is not None:
                region.release()
            raise
        pending = PendingRetrieve(self.conn, rid)
        if region is not None:
            pending._staged(reg, region, block_ids, len(keys), skip_tokens, chains)
            # enqueued after the send: its launch (tens of microseconds) runs while the daemon copies
            if gated and gate_scatter(reg, region, block_ids, len(keys), skip_tokens, scatter_on):
                pending._gated_on(scatter_on)
        return pending

    def submit_store_many(self, reg: Registration, items: Sequence[StoreItem], cache_salt: str = "",
                          request: str = "", after=None, wait_for_room: bool = True, staged=None):
        """Store several prompts' runs (`StoreItem`) in one request; as `submit_store` otherwise
        (engine-side staging: one region and one gather on ``after`` for all of them; ``staged``:
        the region a `stage_store` of all the items' block ids, laid end to end, returned). The
        reply's ``chains`` give each item's stored / present / skipped counts in order; a
        missing parent skips only its own item.

        Returns:
            `kvdepot.client.pending.PendingStore`, or None (``wait_for_room=False`` and no ring
            room now).

        Raises:
            KVDepotError: UNSUPPORTED if the daemon takes no chains (`Registration.chains`),
                INVALID_ARGUMENT for empty or mismatched items, else as `submit_store`.
        """
        keys, ids, chains = join_runs(items, True)
        return self.submit_store(reg, keys, ids, b"", cache_salt, request, after, wait_for_room=wait_for_room,
                                 staged=staged, chains=chains)

    def store_many(self, reg: Registration, items: Sequence[StoreItem], cache_salt: str = "",
                   after=None) -> m.StoreReply:
        """`submit_store_many` and wait for its reply (once the chunks are in L1)."""
        return self.submit_store_many(reg, items, cache_salt, after=after).result()

    def submit_retrieve_many(self, reg: Registration, items: Sequence[RetrieveItem], request: str = "",
                             wait_for_room: bool = True):
        """Retrieve several prompts' runs (`RetrieveItem`) in one request; as `submit_retrieve`
        otherwise. ``.result(before)`` of the handle gives the chunks written over all items
        (staged: one scatter for all of them on ``before``) and its ``chains_retrieved`` each
        item's leading chunks written. A CUDA engine needs engine-side staging for this.

        Raises:
            KVDepotError: as `submit_store_many`.
        """
        keys, ids, chains = join_runs(items, False)
        return self.submit_retrieve(reg, keys, ids, 0, request, wait_for_room, chains=chains)

    def retrieve_many(self, reg: Registration, items: Sequence[RetrieveItem], before=None) -> list[int]:
        """`submit_retrieve_many` and its result: each item's leading chunks written."""
        pending = self.submit_retrieve_many(reg, items)
        pending.result(before)
        return pending.chains_retrieved
