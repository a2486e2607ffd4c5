"""The SCHEDULER-role connector (`SchedulerConnector`, in vLLM's engine-core process).

Per request:

1. ``on_new_request`` / first ``get_num_new_matched_tokens``: the prompt's chunk keys (one
   chain per distinct tensor-parallel shard, one for MLA: `kvdepot.client.vllm.shards`; namespaced by model, layout fingerprint, shard and the
   request's ``cache_salt``; the chain values taken from vLLM's own block hashes where vLLM
   makes them reproducible, else hashed from the tokens: `block_hash_chains`) and a `Lookup`
   pinning the hit chunks under the request id.
   Nothing waits for the reply: until it arrives the answer is ``(None, False)`` ("ask again next
   step"); after ``lookup_timeout_s`` without one it is 0 (recompute) and the daemon is
   considered down (no lookups, answer 0, a ping every ``retry_interval_s``).
2. The hit is ``min(hit_chunks * chunk_size, prompt length)``; the connector offers the tokens
   beyond vLLM's own prefix-cache hit (``num_computed_tokens``) as an *asynchronous* load: vLLM
   allocates blocks and parks the request in WAITING_FOR_REMOTE_KVS; the worker retrieves in
   that step and reports it in finished_recving (failures as invalid blocks for single-group
   models, as failed_recving for hybrid ones, which vLLM supports only that way). A full-prompt
   hit is fine: vLLM recomputes the last token of an asynchronously loaded prompt itself.
3. ``build_connector_meta``: the pending loads, and for every request scheduled this step the
   whole chunks whose tokens this step's forward completes (stored from the current block table,
   ``SchedulerOutput.kv_connector_block_state``).
4. ``request_finished(_all_groups)``: `EndRequest` releases the pins; a request that stored,
   or whose load was not reported in finished_recving yet, keeps its blocks until the workers
   report it in finished_sending (so a late store/retrieve of a slow daemon never touches
   reallocated blocks); one whose loads all ended and that stored nothing is freed at once.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any

import zmq
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.request import RequestStatus

from kvdepot.client.client import KVDepotClient
from kvdepot.client.vllm.config import block_hash_chains
from kvdepot.client.vllm.connector import KVDepotConnector
from kvdepot.client.vllm.events import DepotEvents
from kvdepot.client.vllm.layout import attention_tag
from kvdepot.client.vllm.pins import StorePins
from kvdepot.client.vllm.requests import RequestKeys, RequestState
from kvdepot.client.vllm.stats import StatsTaker
from kvdepot.client.vllm.plan import (KVConnectorWorkerMetadata, KVDepotMetadata, KVDepotWorkerMeta, LoadJob, StoreJob,
                                     blocks_covering, chunk_block_ids, holds_block, plan_load)
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

log = logging.getLogger("kvdepot.vllm")
_WAITING_FOR_REMOTE_KVS = RequestStatus.WAITING_FOR_REMOTE_KVS
# `request_finished`'s answers (delay_free_blocks, kv_transfer_params), made once
_KEEP_BLOCKS: tuple[bool, None] = (True, None)
_FREE_BLOCKS: tuple[bool, None] = (False, None)


class SchedulerConnector(KVDepotConnector, role=KVConnectorRole.SCHEDULER):
    """The SCHEDULER-role connector: vLLM's scheduler calls (see the module docstring; built by
    ``KVDepotConnector(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)``)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg, groups, model_id = self.cfg, self.groups, self.model_id
        self.enabled = not self.disabled_reason
        self.lcm = math.lcm(*(g.block_size for g in groups)) if groups else 1
        self.sliding = any(g.has_null_blocks for g in groups)  # vLLM frees blocks of running requests
        # one key chain per distinct shard (MLA: one, "replicated"; `kvdepot.client.vllm.shards`)
        self.shards = list(self.tp_shards.names)
        self.client = KVDepotClient(cfg.endpoint, timeout_s=cfg.lookup_timeout_s, name=f"vllm-scheduler-{os.getpid()}",
                                    connect=False, retry_interval_s=cfg.retry_interval_s)
        self._reqs: dict[str, RequestState] = {}
        # requests whose prompt has whole chunks not stored yet (without store_generated, the
        # only ones a step may store: a decode step then looks at none, however many run)
        self._unstored: dict[str, RequestState] = {}
        self._ineligible: set[str] = set()
        self._pending_loads: list[tuple[str, tuple[list[int], ...], int, int]] = []  # (req, block ids, local, end)
        self._release: list[str] = []
        self._loading: dict[str, tuple] = {}  # request -> its block ids per vLLM gid, while its load runs
        self._null_block_id = 0
        self._idle_meta: KVDepotMetadata | None = None  # what a step with nothing to do gets
        # a sliding-window model whose stores are not pinned: each step's metadata names the
        # blocks its forward may write (`written_blocks`)
        self._written_each_step = self.sliding and self.enabled
        self._epoch = 0
        self._kv_cache_manager = None
        self._get_blocks = None
        # sliding-window models: the pins on the blocks a store reads, in vLLM's block pool,
        # until every worker reported its save ended (`bind_gpu_block_pool`); None: not pinned
        self._pins: StorePins | None = None
        self.stats = {"blocks_pinned": 0, "blocks_unpinned": 0}  # (`kvdepot.client.vllm.stats.COUNTERS`)
        # (None: nothing ever pinned, no pair to keep balanced; `bind_gpu_block_pool`)
        self._stats = StatsTaker(self.stats, balanced=None)
        pc = vllm_config.parallel_config  # every worker of the engine reports each pinned save
        self._workers = (pc.tensor_parallel_size * int(getattr(pc, "pipeline_parallel_size", 1) or 1)
                         * int(getattr(pc, "prefill_context_parallel_size", 1) or 1))
        self._sliding_gids = [i for i, g in enumerate(groups) if g.has_null_blocks]
        # per group, the blocks of each chunk a store leaves to vLLM's null block: a load is
        # never given them (`TransferGroup.kept_from`), so they are neither pinned nor read
        self._dropped = [g.kept_from(cfg.chunk_size) for g in groups]
        # per group, what `_store_job` reads of it: (vLLM gid, blocks per chunk, whether a null
        # block in its table is an error (groups that never hold one), blocks left to the null block)
        self._store_groups = [(g.vllm_gid, cfg.chunk_size // g.block_size, not g.has_null_blocks, drop)
                              for g, drop in zip(groups, self._dropped)]
        # no group holds null blocks: a new request's store job names its table and range, and
        # the worker's transfer thread slices the ids (`StoreJob.lazy`)
        self._lazy_stores = not self.sliding and all(no_nulls and not drop for _, _, no_nulls, drop in self._store_groups)
        # vLLM block hashes per chunk where chain values come from them (0: tokens hashed here)
        self._blocks_per_chunk, self._chain_source = block_hash_chains(cfg, vllm_config, kv_cache_config)
        self._attention = attention_tag(kv_cache_config, groups)  # sliding windows etc. (`namespace_seed`)
        self._keys = RequestKeys(cfg.chunk_size, model_id, self.fingerprint, self.shards, self._blocks_per_chunk,
                                 self._chain_source, self._attention)
        if not self._blocks_per_chunk and cfg.key_source == "auto" and self.enabled:
            log.info("kvdepot: chunk keys hashed from tokens, not vLLM's block hashes: %s", self._chain_source)
        # vLLM's KV events (--kv-events-config): what the depot holds of this engine's prompts
        kec = getattr(vllm_config, "kv_events_config", None)
        hbs = int(getattr(kv_cache_config, "hash_block_size", 0) or 0)
        self._events: DepotEvents | None = None
        if self.enabled and kec is not None and kec.enable_kv_cache_events and hbs and cfg.chunk_size % hbs == 0:
            self._events = DepotEvents(cfg.endpoint, model_id, hbs, cfg.chunk_size)

    # ------------------------------------------------------------------ helpers

    def get_loaded_kv_cache_group_ids(self, request) -> tuple[int, ...]:
        return tuple(g.vllm_gid for g in self.groups)

    def bind_kv_cache_manager(self, manager) -> None:
        """vLLM's ``KVCacheManager``; the base class's call binds its block pool
        (`bind_gpu_block_pool`) first."""
        super().bind_kv_cache_manager(manager)
        # vLLM's KVCacheCoordinator.get_blocks: a request's KVCacheBlock lists per vLLM gid
        # (None where this vLLM has no such call: store jobs then take vLLM's id tables)
        self._get_blocks = getattr(getattr(manager, "coordinator", None), "get_blocks", None)
        null = getattr(getattr(manager, "block_pool", None), "null_block", None)
        if null is not None:
            self._null_block_id = null.block_id
        self._idle_meta = None

    def bind_gpu_block_pool(self, pool) -> None:
        """vLLM's ``BlockPool`` (``bind_gpu_block_pool``): for a model with a sliding-window
        group, every store's sliding-window blocks are pinned (``touch``) until every worker
        reported its save ended (`KVDepotWorkerMeta`), so vLLM cannot give them to another
        request while a gather may still read them (a pinned block stays in use for vLLM: its
        ``reset_prefix_cache`` fails until the pins dropped). Needs vLLM's worker metadata
        channel (``build_connector_worker_meta``, vLLM >= 0.33); without it the workers order each forward after the gathers of the
        stores whose blocks it may write (``written_block_ids``)."""
        if (self.sliding and self.enabled and KVConnectorWorkerMetadata is not None
                and hasattr(pool, "touch") and hasattr(pool, "blocks")):
            self._pins = StorePins(pool, self._sliding_gids, self._workers, self.stats)
            self._stats.balanced = ("blocks_pinned", "blocks_unpinned")
            self._written_each_step = False
            self._idle_meta = None

    @property
    def pins_stores(self) -> bool:
        """Whether the sliding-window blocks of stores are pinned (`bind_gpu_block_pool`)."""
        return self._pins is not None

    @property
    def pinned_blocks(self) -> int:
        """Blocks the scheduler holds a pin on now (sliding-window stores not ended)."""
        return self._pins.held if self._pins is not None else 0

    def _state(self, request) -> RequestState | None:
        """The request's state, created (keys hashed) on first sight; None if not cached."""
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is not None or not self.enabled or rid in self._ineligible:
            return st
        from_block_hashes = bool(self._blocks_per_chunk and request.block_hashes)
        if getattr(request, "resumable", False) or (
                (request.prompt_token_ids is None or getattr(request, "prompt_embeds", None) is not None
                 or getattr(request, "mm_features", None)) and not from_block_hashes):
            # placeholder tokens of images / embeddings do not identify the KV, so such a request
            # shares none unless vLLM's block hashes key it: they hold each block's multimodal
            # items (vLLM's ``("mm", identifier, offset)`` extra keys) and the SHA-256 of its
            # prompt embeddings (``("prompt_embeds", digest)``), chained
            self._ineligible.add(rid)
            return None
        salt, cache_salt = self._keys.seed_salt(request, self._epoch)
        st = RequestState(request, salt, cache_salt, [[] for _ in self.shards], [], 0)
        # a request without block hashes (vLLM built it without a block hasher) hashes its tokens
        st.from_block_hashes = from_block_hashes
        self._keys.extend(st, request.num_prompt_tokens)
        self._reqs[rid] = st
        if self.cfg.store and st.keys[0]:
            self._unstored[rid] = st
        return st

    def _send(self, req: m.Msg, on_reply=None) -> int | None:
        """Send without waiting (``on_reply``: `Connection.submit`'s); None (and the daemon
        marked down) if it cannot be sent."""
        try:
            return self.client.submit(req, on_reply)
        except (KVDepotError, zmq.ZMQError, OSError) as exc:
            log.warning("kvdepot: cannot send %s to %s: %s", type(req).__name__, self.cfg.endpoint, exc)
            self.client.mark_down()
            return None

    def _send_lookup(self, st: RequestState) -> None:
        if not self.client.available():
            st.hit_chunks = 0  # daemon down: recompute, no waiting
            return
        n = len(st.keys[0])
        if n == 0:
            st.hit_chunks = 0
            return
        # (the answer is booked on ``st`` as it is read, `RequestState.answer`: no read comes before
        # ``lookup_rid`` is set below)
        st.lookup_error = None
        rid = self._send(m.Lookup(rid=0, keys=st.keys, chunk_size=self.cfg.chunk_size,
                                  num_tokens=st.request.num_prompt_tokens, model=self.model_id,
                                  pin_request=st.request.request_id), st.answer)
        if rid is None:
            st.hit_chunks = 0
        else:
            st.lookup_rid = rid
            st.lookup_sent_s = time.monotonic()
            st.pinned = True

    def _lookup_answer(self, st: RequestState) -> int | None:
        """Hit chunks, or None while the answer is pending (never waits)."""
        if st.hit_chunks is not None:  # (booked by `RequestState.answer` when the client read it)
            return st.hit_chunks
        if st.lookup_rid is None:
            self._send_lookup(st)
            if st.hit_chunks is not None:
                return st.hit_chunks
        c = self.client
        if st.lookup_error is None:
            c.poll()  # reads every reply that came: each lookup's is booked on its request
            if st.hit_chunks is not None:
                return st.hit_chunks
        err = st.lookup_error
        if err is not None:
            log.warning("kvdepot: lookup of request %s failed: %s", st.request.request_id,
                        KVDepotError(err.code, err.message))  # (its text: "[CODE] message")
            if err.code in (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED, ErrorCode.UNAVAILABLE, ErrorCode.BACKPRESSURE):
                c.mark_down()
        elif c.up and time.monotonic() - st.lookup_sent_s < self.cfg.lookup_timeout_s:
            return None
        else:
            log.warning("kvdepot: no lookup answer within %.1f s; request %s is computed without cached KV",
                        self.cfg.lookup_timeout_s, st.request.request_id)
            c.forget(st.lookup_rid)
            c.mark_down()
        st.hit_chunks = 0
        st.lookup_rid = st.lookup_error = None
        return 0

    # ------------------------------------------------------------------ vLLM calls

    def on_new_request(self, request) -> None:
        st = self._state(request)
        if st is not None and self.cfg.load and st.hit_chunks is None and st.lookup_rid is None:
            self._send_lookup(st)  # the answer is usually back before the first schedule() sees it

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)
        if st is None or not self.cfg.load or st.load_failed:
            return 0, False
        hit = self._lookup_answer(st)
        if not hit:  # not known yet (None), or a miss
            return (None, False) if hit is None else (0, False)
        st.local_tokens = num_computed_tokens
        total = min(hit * self.cfg.chunk_size, request.num_prompt_tokens)
        if total <= num_computed_tokens or num_computed_tokens % self.lcm:
            # nothing beyond vLLM's own hit; or that hit ends inside some group's block, so the
            # daemon could not leave exactly vLLM's blocks untouched
            return 0, False
        return total - num_computed_tokens, True

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        self._pending_loads.append((request.request_id, blocks.get_block_ids(), st.local_tokens,
                                    st.local_tokens + num_external_tokens))

    def build_connector_meta(self, scheduler_output) -> KVDepotMetadata:
        # (no socket read here: lookup answers are read where they are asked for,
        # `_lookup_answer`, and the daemon's other replies with them)
        if self.cfg.store and self.enabled and (self._unstored or self.cfg.store_generated):
            scheduled = scheduler_output.num_scheduled_tokens
            if self.cfg.store_generated:
                todo = list(scheduled)
            else:  # by the shorter of the two: many requests may wait with their prompts unstored
                unstored = self._unstored
                todo = ([rid for rid in unstored if rid in scheduled] if len(unstored) <= len(scheduled)
                        else [rid for rid in scheduled if rid in unstored])
        else:
            todo = ()
        pending, release, preempted_ids = self._pending_loads, self._release, scheduler_output.preempted_req_ids
        if not (todo or pending or release or preempted_ids or self._written_each_step):
            # most decode steps: nothing for the workers. One shared metadata of empty tuples
            # (vLLM only passes it on): building one cost such a step 3-4 us of cold caches
            idle = self._idle_meta
            if idle is None:
                idle = self._idle_meta = KVDepotMetadata(
                    loads=(), stores=(), release=(), preempted=(), fingerprint=self.fingerprint,
                    null_block_id=self._null_block_id, stores_pinned=self._pins is not None)
            return idle
        # the lists first, the metadata last with all of them (no default factories to run);
        # what is empty is the shared empty tuple: no list made (and later freed) for it
        loads = stores = preempted = ()
        if preempted_ids:
            preempted = list(preempted_ids)
            for rid in preempted:
                st = self._reqs.get(rid)
                if st is not None:  # its blocks are gone; ask the daemon again when it is rescheduled
                    if st.lookup_rid is not None:
                        self.client.forget(st.lookup_rid)
                    st.lookup_rid = st.hit_chunks = st.lookup_error = None
        if pending:
            loads = []
            for req_id, block_ids, local, end in pending:
                job = self._load_job(req_id, block_ids, local, end)
                if job is not None:
                    loads.append(job)
            self._pending_loads = []
        if todo:
            stores = []
            state = getattr(scheduler_output, "kv_connector_block_state", None)
            scheduled = scheduler_output.num_scheduled_tokens
            # the tables of requests new in this step, as vLLM already built them (id lists):
            # taken by slicing, where the live blocks would be read one KVCacheBlock at a time
            new_tables = {r.req_id: r.block_ids for r in scheduler_output.scheduled_new_reqs}
            unstored = self._unstored
            for req_id in todo:
                job = self._store_job(req_id, scheduled[req_id], state, new_tables.get(req_id), unstored.get(req_id))
                if job is not None:
                    stores.append(job)
                st = unstored.get(req_id)
                if st is not None and (st.store_stopped or st.next_store_chunk >= len(st.chain)):
                    del unstored[req_id]  # its prompt's chunks are all stored (or never will be)
        if release:
            self._release = []
        else:
            release = ()
        meta = KVDepotMetadata(loads, stores, release, preempted, self.fingerprint, self._null_block_id)
        if self._pins is not None:
            meta.stores_pinned = True
            if stores:
                meta.pin_seq = self._pins.pin(stores, self._null_block_id)
        elif self._written_each_step:
            meta.written_block_ids = written_blocks(scheduler_output)
        return meta

    def _load_job(self, req_id: str, block_ids, local: int, end: int) -> LoadJob | None:
        st = self._reqs.get(req_id)
        if st is None:
            return None
        c = self.cfg.chunk_size
        p = plan_load(local, end, c)
        ids, fail_ids = [], []
        for g in self.groups:
            table = block_ids[g.vllm_gid]
            got = chunk_block_ids(table, g.block_size, c, p.first_chunk, p.first_chunk + p.num_chunks)
            ids.append(got if got is not None else [])
            fail_ids.append(blocks_covering(table, g.block_size, local, end) if self.single_group else [])
        self._loading[req_id] = block_ids  # as a set only when a worker reports invalid blocks
        return LoadJob(req_id=req_id, chain=st.chain[p.first_chunk:p.first_chunk + p.num_chunks], seed=st.seed,
                       first_chunk=p.first_chunk, skip_tokens=p.skip_tokens, block_ids=ids, local_tokens=local,
                       end_tokens=end, fail_block_ids=fail_ids)

    def _store_job(self, req_id: str, num_scheduled: int, block_state, new_table=None,
                   st: RequestState | None = None) -> StoreJob | None:
        """The store of the whole chunks this step's forward completes (None: nothing to
        store). ``new_table``: the request's block ids per vLLM gid where it is new in this
        step (``NewRequestData.block_ids``, its whole table as of this step's allocation);
        else its live blocks are read (`_blocks_of`). ``st``: its state, where the caller has
        it."""
        if st is None:
            st = self._reqs.get(req_id)
        if st is None or st.store_stopped:
            return None
        req = st.request
        done = req.num_computed_tokens + num_scheduled  # tokens whose KV exists after this step
        limit = min(done, req.num_tokens) if self.cfg.store_generated else min(done, req.num_prompt_tokens)
        c = self.cfg.chunk_size
        end_chunk = limit // c
        if end_chunk <= st.next_store_chunk:
            return None
        if self.cfg.store_generated:
            self._keys.extend(st, limit)
        end_chunk = min(end_chunk, len(st.chain))
        first = st.next_store_chunk
        if end_chunk <= first:
            return None
        ids = lazy = None
        if new_table is not None and self._lazy_stores:
            # the table and the range only: the worker's transfer thread slices (`StoreJob.lazy`)
            ranges = []
            for gid, per, _, _ in self._store_groups:
                held, hi = new_table[gid], end_chunk * per
                if hi > len(held):
                    break
                ranges.append((held, first * per, hi))
            else:
                lazy = (ranges, self._null_block_id)
        if lazy is None:
            ids = self._store_block_ids(st, req_id, first, end_chunk, block_state, new_table)
            if ids is None:
                return None
        st.next_store_chunk = end_chunk
        st.stored = True
        if self._events is not None:
            keys = st.keys[0]
            for i in range(first, end_chunk):
                self._events.planned(keys[i], i, req)
        chain = st.chain
        return StoreJob(req_id, chain[first:end_chunk], chain[first - 1] if first else b"", st.seed, first, ids,
                        st.cache_salt, lazy)

    def _store_block_ids(self, st: RequestState, req_id: str, first: int, end_chunk: int, block_state,
                         table) -> list[list[int]] | None:
        """A store job's block ids per daemon gid, read on the step (`_store_job`); None (and
        the request's later stores stopped) where a group's table is short or holds vLLM's
        null block where none can be."""
        # ``table``: vLLM's id lists of a request new in the step; else its KVCacheBlock lists
        # (ids of the chunks' blocks only), else its id tables
        blocks = self._blocks_of(req_id) if table is None else None
        if table is None and blocks is None:
            table = block_state.get_block_ids(req_id) if block_state is not None else None
            if table is None and self._kv_cache_manager is not None:
                table = self._kv_cache_manager.get_block_ids(req_id)
            if table is None:
                return None
        ids = []
        null = self._null_block_id
        for gid, per, no_nulls, drop in self._store_groups:
            lo, hi = first * per, end_chunk * per
            if blocks is not None:
                held = blocks[gid]
                got = [b.block_id for b in held[lo:hi]] if hi <= len(held) else None
            else:  # (`chunk_block_ids`, inline: one call less per store step)
                held = table[gid]
                got = (held[lo:hi] if type(held) is list else list(held[lo:hi])) if hi <= len(held) else None
            if got is None or (no_nulls and holds_block(got, null)):
                log.warning("kvdepot: request %s: no blocks for chunks %d..%d of KV-cache group %d; "
                            "its later chunks are not stored", req_id, first, end_chunk - 1, gid)
                st.store_stopped = True
                return None
            if drop:
                nulls = [null] * drop
                for j in range(0, len(got), per):
                    got[j:j + drop] = nulls
            ids.append(got)
        return ids

    def _blocks_of(self, req_id: str):
        """The request's blocks per vLLM gid (``KVCacheBlock`` lists, vLLM's
        ``KVCacheCoordinator.get_blocks``): a long request's table as ids would be built whole
        (``KVCacheManager.get_block_ids``) to take a few chunks' blocks. None where this vLLM
        has no such call (the caller then takes the ids)."""
        return self._get_blocks(req_id) if self._get_blocks is not None else None

    def request_finished_all_groups(self, request, block_ids=None) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished`` (one group) and ``request_finished_all_groups``
        (``block_ids``, per group or not, is not read: the workers hold what a transfer still
        touches). Returns (delay_free_blocks, kv_transfer_params)."""
        rid = request.request_id
        st = self._reqs.pop(rid, None)
        if st is None:  # (a request with state is never ineligible)
            self._ineligible.discard(rid)
            self._loading.pop(rid, None)
            return _FREE_BLOCKS
        loading = self._loading.pop(rid, None) is not None if self._loading else False
        self._unstored.pop(rid, None)
        if st.lookup_rid is not None:
            self.client.forget(st.lookup_rid)
        if st.pinned and self.client.up:
            end = self._send(m.EndRequest(rid=0, request=rid))
            if end is not None:
                self.client.forget(end)  # fire and forget: pins also expire by TTL
        # its blocks wait for the workers only while a transfer may still touch them: after a
        # store (the gather may run after later forwards), or a load not reported yet. A
        # request whose loads all ended (finished_recving) and that stored nothing is freed at
        # once, a step or two earlier. One aborted while its load runs is freed by vLLM itself on
        # finished_recving.
        if (st.stored or loading) and request.status != _WAITING_FOR_REMOTE_KVS:
            self._release.append(rid)
            return _KEEP_BLOCKS
        return _FREE_BLOCKS

    request_finished = request_finished_all_groups

    def update_connector_output(self, connector_output) -> None:
        # (most steps bring nothing: no set is built for them)
        pins = self._pins
        if pins is not None and pins.saves:
            worker_meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(worker_meta, KVDepotWorkerMeta):
                pins.unpin(worker_meta.saves_ended)
        failed = connector_output.failed_recving
        invalid = connector_output.invalid_block_ids
        if invalid:
            invalid = set(invalid)
            failed = set(failed or ())
            failed.update(rid for rid, tables in self._loading.items()
                          if any(not invalid.isdisjoint(table) for table in tables))
        for rid in failed or ():
            st = self._reqs.get(rid)
            if st is not None:  # vLLM recomputes it; offering the same hit again would loop
                st.load_failed = True
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)

    def reset_cache(self) -> bool:
        """After a weight update: move this engine's keys to a fresh namespace (so the old KV
        can never be served) and send the daemon a `Flush` of this model's chunks without
        waiting for it. True if the flush was sent."""
        self._epoch += 1
        for st in self._reqs.values():
            if st.lookup_rid is not None:
                self.client.forget(st.lookup_rid)
            st.seed_salt, _ = self._keys.seed_salt(st.request, self._epoch)
            st.keys, st.chain, st.seed, st.hashed_tokens = [[] for _ in self.shards], [], b"", 0
            self._keys.extend(st, st.request.num_prompt_tokens)
            st.lookup_rid = st.hit_chunks = st.lookup_error = None
            st.next_store_chunk = 0
            if self.cfg.store and st.keys[0] and not st.store_stopped:
                self._unstored[st.request.request_id] = st  # stored again under the new keys
        # sent without waiting (vLLM calls this on its engine-core thread); the new namespace
        # already protects correctness, so a flush that never arrives only leaves dead chunks to LRU
        rid = self._send(m.Flush(rid=0, model=self.model_id))
        if rid is None:
            return False
        self.client.forget(rid)
        return True

    def take_events(self) -> list:
        """vLLM ``KVCacheEvent``s since the last call (`DepotEvents.take`); empty without
        ``--kv-events-config``."""
        return self._events.take() if self._events is not None else []

    def shutdown(self) -> None:
        if self._events is not None:
            self._events.close()
        self.client.close()


def written_blocks(so) -> list[int]:
    """Blocks a step may write that their request did not hold before it (`KVDepotMetadata`
    ``written_block_ids``), from vLLM 0.33's ``SchedulerOutput``: new requests' tables, the
    blocks appended to running ones (a resumed request's whole table), blocks zeroed before the
    forward and copy-on-write destinations. A flat list, built by list extends (a 4096-token
    prompt of a two-group model is 512 ids: as a set 11 us on the dev VM, as this 1-2): ids
    may repeat and vLLM's null block may be among them; a worker makes a set of them only when
    it has a store to order against (`kvdepot.client.vllm.worker.written_set`). A load's
    scatter needs no entry of its own: it writes only blocks of new or resumed requests' tables,
    which are here."""
    out: list[int] = []
    for r in so.scheduled_new_reqs:
        for ids in r.block_ids:
            out += ids
    cached = so.scheduled_cached_reqs
    for per_group in getattr(cached, "new_block_ids", ()) or ():
        for ids in per_group or ():
            out += ids
    out += getattr(so, "new_block_ids_to_zero", None) or ()
    out += [copy.dst_block_id for copy in getattr(so, "kv_cache_block_copies", None) or ()]
    return out
