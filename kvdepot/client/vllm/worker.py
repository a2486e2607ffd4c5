"""The WORKER-role connector (`WorkerConnector`, one per GPU / CPU worker process): a thin
adapter over `kvdepot.client.KVDepotClient`, run by a transfer thread of its own
(`kvdepot.client.vllm.mover.TransferThread`). Nothing on the engine's step waits for the daemon,
and the step itself only posts work and takes results.

Per step (order of vLLM's ``KVConnectorModelRunnerMixin``): ``handle_preemptions`` ->
``bind_connector_metadata`` -> forward -> ``start_load_kv`` -> ``wait_for_save`` ->
``get_finished`` -> ``get_block_ids_with_load_errors``.

* Loads (in ``bind_connector_metadata``, before the forward's launch): an
  event is recorded on the engine's stream and the step's load
  jobs go to the transfer thread, which submits every retrieve. CUDA engines: the daemon copies
  the chunks into a device staging ring (engine-side staging, `kvdepot.client.staging`); the
  thread scatters them into the blocks on its own stream once the reply came; ``get_finished``
  reports the request in finished_recving and makes the engine's stream wait for the scatter.
  What was not retrieved is reported as failed (invalid blocks for single-group models,
  failed_recving for hybrid ones) and vLLM recomputes it. vLLM's null block (which a
  sliding-window group's table holds for tokens outside the window) is left out of the scatter
  (block id -1).
* Stores (``wait_for_save``, after the forward): an event is recorded on the engine's stream and
  the step's store jobs go to the thread, which gathers the chunks into the ring after that
  event and sends the `Store`. Models with a sliding-window group (vLLM frees blocks that leave
  the window while their request runs; CUDA): the save goes with the engine's stream, and the
  thread gathers on that stream when it takes it, unless ``bind_connector_metadata`` finds that
  the next forward may write one of its blocks first: then the engine thread gathers it there
  (`kvdepot.client.vllm.pieces.PostedSave`). CPU: the daemon reads the shared-memory blocks itself. A finished
  request keeps its blocks (vLLM's ``delay_free_blocks``) until its stores and loads ended, then
  is reported in finished_sending. Ranks holding the same shard (MLA's latent KV, identical on
  every rank: `kvdepot.client.vllm.shards`) load it all; only the first of them stores it.
* No per-layer calls: ``has_connector_metadata`` is False, so vLLM's attention layers never call
  ``wait_for_layer_load`` / ``save_kv_layer`` (the thread needs no pumping).

The transfer thread's parts: the `kvdepot.client.vllm.planner.Planner` (a job's keys, block ids
and pieces: no socket, no GPU), the `kvdepot.client.vllm.sender.Sender` (pieces queued, staged
and sent as the ring has room), `TransferThread` itself (commands in, replies read, results
out) and the `kvdepot.client.vllm.registrar.WorkerRegistrar` (registration with the daemon,
again after its restart).

Two threads: the engine thread (vLLM's calls) and the transfer thread. Who owns what, and the
only channels between them (the last rows); nothing else crosses:

| state | written by | read by |
|---|---|---|
| `WorkerConnector`'s step state (``_meta``, ``_saves_posted``, ``_gather_in_wait``, ``_sliding_saves``, ``_released``, ``_loads_started``, ``_invalid_blocks``, ``_saves_ended``, ``_stream``) | engine | engine |
| ``reg``, ``cfg``, ``groups``, ``shard``, ``stores_chunks``, the client object | engine, before the transfer thread starts | both, read-only after |
| the `WorkerRegistrar`'s ``kvreg``, ``generation``, ``disabled_reason`` | transfer thread (`ready`, `disable`), engine before it starts | engine, one reference each (`registration_id`, `stage_saves`); a stale one is refused where used (`StagedSaves.generation`) |
| ``stores_may_wait`` | engine (`bind_connector_metadata`: turns True once the scheduler pins stores, never back) | transfer thread |
| ``stats`` | per key one thread: ``forwards_waiting_for_gathers``, ``saves_gathered_by_bind`` the engine, the rest the transfer thread | engine (``get_kv_connector_stats``) |
| the `KVDepotClient`'s socket, requests and replies | transfer thread | transfer thread |
| the staging ring (`kvdepot.client.staging.StagingRing`) | both, under its lock (the engine thread's gathers: `stage_saves`) | both |
| `TransferThread`'s `Book` (queue, ops, stopped requests, loads), released requests, pins, settles | transfer thread | transfer thread |
| the `Planner` (its cache of keys' masks) and the `Sender` (its side stream) | transfer thread | transfer thread; the engine thread calls only `Sender.stage_saves`, which reads neither (the planner's block ids and pieces only) |
| channel: the inbox of `kvdepot.client.vllm.commands` | engine puts | transfer thread takes, in order |
| channel: ``outbox`` (`Results`) | transfer thread appends | engine pops (``get_transfer_results``) |
| channel: `PostedSave` | whichever side claims it first (its lock) | the other |
| channel: `Preemption` | engine makes it, the transfer thread sets ``done`` | engine waits |
| channel: saves gathered (``_saves_gathered``, ``_gather_events``, under ``_saves_cond``) | transfer thread; engine drops events it no longer needs (``forget_gathered``) | engine (``saves_gathered``, ``gathered``) |
| channel: `Wake` (a pipe) | engine signals (a `Load`, `Preempt`, `Stop`) | transfer thread's wait for replies |
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, KVConnectorTransferResults

from kvdepot.client.client import KVDepotClient
from kvdepot.client.vllm import commands as cmds
from kvdepot.client.vllm.connector import KVDepotConnector
from kvdepot.client.vllm.layout import ShmSegments
from kvdepot.client.vllm.mover import TransferThread
from kvdepot.client.vllm.pieces import PostedSave
from kvdepot.client.vllm.plan import KVDepotMetadata, KVDepotWorkerMeta
from kvdepot.client.vllm.registrar import WorkerRegistrar
from kvdepot.client.vllm.stats import StatsTaker

log = logging.getLogger("kvdepot.vllm")

# after `bind_connector_metadata` gathered a save the thread had not taken: this many saves are gathered in
# wait_for_save before the thread is tried again, twice as many after each further miss (up to
# GATHER_IN_WAIT_RETRY_MAX), GATHER_IN_WAIT_RETRY again once the thread made it in time
GATHER_IN_WAIT_RETRY = 16
GATHER_IN_WAIT_RETRY_MAX = 1024
# what `WorkerConnector.get_transfer_results` returns when nothing ended: frozen, so that one shared
# value can go to vLLM step after step (code that tried to add to it would raise, not corrupt)
NOTHING_ENDED: tuple[frozenset, frozenset, frozenset] = (frozenset(), frozenset(), frozenset())
NO_RESULTS = KVConnectorTransferResults(*NOTHING_ENDED)  # (`WorkerConnector.get_transfer_results`)


class WorkerConnector(KVDepotConnector, role=KVConnectorRole.WORKER):
    """The WORKER-role connector: vLLM's worker calls, on the engine thread (see the module
    docstring; built by ``KVDepotConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)``)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        cfg, groups = self.cfg, self.groups
        # a store may wait for ring room only where vLLM never frees a running request's blocks
        self.stores_may_wait = not any(g.has_null_blocks for g in groups)
        # sliding-window models: a store that finds the staging ring full is skipped (counted),
        # never queued, pinned blocks or not: it would hold blocks vLLM counts on getting back
        self.stores_skip_when_full = not self.stores_may_wait
        self.max_step_tokens = int(getattr(vllm_config.scheduler_config, "max_num_batched_tokens", 0) or 0)
        self.tp_rank = _tp_rank(vllm_config.parallel_config.tensor_parallel_size)
        self.shard = self.tp_shards.of(self.tp_rank)
        # ranks holding the same shard (MLA's replicated latent KV): the first stores, all load
        self.stores_chunks = self.tp_shards.stores(self.tp_rank)
        self.client = KVDepotClient(cfg.endpoint, timeout_s=cfg.rpc_timeout_s,
                                    name=f"vllm-worker-{os.getpid()}-tp{self.tp_rank}", connect=False,
                                    retry_interval_s=cfg.retry_interval_s)
        self.registrar = WorkerRegistrar(self.client, cfg, self.model_id, self.shard, self.fingerprint,
                                         self.max_step_tokens, self.stores_skip_when_full, self.disabled_reason)
        self.stats = {"loads": 0, "load_failures": 0, "loaded_chunks": 0, "stores": 0, "stored_chunks": 0,
                      "store_failures": 0, "stores_skipped_ring_full": 0, "pieces_queued": 0, "late_ops": 0,
                      "null_blocks_left_alone": 0, "forwards_waiting_for_gathers": 0, "saves_gathered_by_bind": 0,
                      "thread_cpu_s": 0.0}
        self._stats = StatsTaker(self.stats)
        self._shm: ShmSegments | None = None  # CPU workers' KV cache (`get_mem_pool_context`)
        self.mover = TransferThread(self)
        self._outbox = self.mover.outbox  # its published results (`get_transfer_results` takes them)
        self._post_quiet = self.mover.post_quiet  # (`TransferThread.post` of a save or release)
        # the per-step calls read these plain attributes (no property, no chain of them): each
        # object or function a call touches first is a cache miss in a real step
        self._active = False  # the transfer thread runs (`register_kv_caches` started it)
        self._cuda = False  # vLLM's caches are CUDA tensors
        self._meta: KVDepotMetadata | None = None
        self._saves_posted = 0
        self._gather_in_wait = 0  # sliding-window models: saves the engine thread gathers in wait_for_save
        self._gather_retry = GATHER_IN_WAIT_RETRY  # the next such run after a miss
        self._sliding_saves: list[_SlidingSave] = []  # sliding-window models: saves maybe not gathered yet
        self._released: KVDepotMetadata | None = None  # the metadata whose releases were posted
        self._loads_started: KVDepotMetadata | None = None  # the metadata whose loads went out last
        self._invalid_blocks: set[int] = set()  # taken by get_transfer_results, given by the next call
        self._saves_ended: set[int] = set()  # pinned saves ended, for the next `build_connector_worker_meta`
        self._stream: tuple[int, torch.cuda.Stream | None] = (0, None)  # (raw pointer, the current stream)
        self._stream_src: tuple | None = None  # (torch's raw current-stream call, device index)

    @property
    def registration_id(self) -> str | None:
        """The daemon's id of this worker's registration, while it is current."""
        return self.registrar.registration_id

    def get_mem_pool_context(self):
        """CPU workers: allocate the KV cache in shared memory, where the daemon can map it."""
        if self.device_type != "cpu" or self.disabled_reason:
            return None
        if self._shm is None:
            self._shm = ShmSegments()
        return self._shm.allocation_context()

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """vLLM's caches, once, before the first step (engine thread): registered with the
        daemon (`WorkerRegistrar.register_caches`), then the transfer thread starts."""
        self.registrar.register_caches(kv_caches, self._kv_cache_config, self.groups)
        reg = self.registrar.reg
        self._cuda = reg is not None and reg.device == "cuda"
        self.mover.start()  # disabled too: it ends the loads the scheduler still plans (recomputed)
        self._active = True

    # ------------------------------------------------------------------ per step (engine thread)

    def bind_connector_metadata(self, meta: KVDepotMetadata) -> None:
        """Before the forward: the step's plan (metadata of another kind, which vLLM's
        scheduler-role connector never sends, is taken as a step with nothing to do). The base
        class's ``_connector_metadata`` is not kept: nothing reads it, as
        ``has_connector_metadata`` is always False.
        For a model with a sliding-window group (vLLM frees blocks that
        leave the window while their request runs), the forward must not write a block before
        an earlier step's store gathered it: the scheduler pins those blocks until the save
        ended (``meta.stores_pinned``: nothing to do here), else see `_order_after_gathers`.

        The step's loads start here (`_start_loads`), before vLLM launches the forward, not in
        ``start_load_kv`` after it: vLLM enqueues its own work on the loading requests' new
        blocks (``new_block_ids_to_zero``, copy-on-write copies) before it binds the metadata,
        in both of its GPU model runners, and the forward writes none of those blocks (their
        requests wait for the load). Posting a load costs the engine thread the same here; the
        load starts a forward's launch earlier, and may end within the step instead of the
        next one."""
        if meta.__class__ is not KVDepotMetadata:
            meta = None
        self._meta = meta
        if not self.stores_may_wait and meta is not None and meta.stores_pinned:
            # the scheduler pins the sliding-window blocks of every store until its save ended:
            # nothing orders a forward after the gathers any more (the same for every step)
            self.stores_may_wait = True
        if self._sliding_saves and self._active:
            ours = meta is not None
            self._order_after_gathers(written_set(meta.written_block_ids if ours else None,
                                                  meta.null_block_id if ours else None))
        if meta is not None and meta.loads:
            self._start_loads(meta)  # after the stream waits above: the scatters follow them too

    def _order_after_gathers(self, written: set[int] | None) -> None:
        """Make the engine's stream wait for the gathers of every earlier store that reads a
        block of ``written`` (blocks this step may write that their request did not hold: the
        scheduler's ``written_block_ids``, `written_set`; None: all of them). A save the
        transfer thread has not taken yet is gathered here, on the engine's stream
        (`_gather_here`); one it is gathering is waited for on the CPU; one whose gathers are
        on the side stream, on the GPU. Saves gathered on the engine's stream already, or whose
        blocks this step leaves alone, cost no wait (the check comes again next step for
        those not gathered yet). The loads of this step write only blocks of ``written``
        (new requests' tables, resumed requests'), so their scatters need no more."""
        mover, keep, ordered = self.mover, [], 0  # ordered: saves <= this need nothing more
        for s in self._sliding_saves:
            handled, ev = mover.gathered(s.seq)
            if handled and (ev is None or ev.query()):  # its gathers ran or are on this stream
                if s.posted is not None and s.posted.owner == "thread":
                    self._gather_retry = GATHER_IN_WAIT_RETRY  # the thread made it in time
                if ev is None and s.posted is not None and keep:
                    continue  # on the engine's stream: says nothing of the side-stream saves kept
                ordered = s.seq  # and those of every earlier save (handled in order)
                continue
            if written is not None and s.blocks().isdisjoint(written):
                keep.append(s)
                continue
            if not handled and s.posted is not None and self._gather_here(s):
                continue  # on this stream now (earlier saves may still be the thread's)
            if not handled:
                ev = mover.saves_gathered(s.seq, self.cfg.rpc_timeout_s)
            if ev is not None:
                self._current_stream().wait_event(ev)
            self.stats["forwards_waiting_for_gathers"] += 1
            ordered = s.seq  # the side stream runs in order: earlier saves' gathers came before
        if ordered:
            mover.forget_gathered(ordered)
            keep = [s for s in keep if s.seq > ordered]
        self._sliding_saves = keep

    def _gather_here(self, s: _SlidingSave) -> bool:
        """Claim save ``s`` (`PostedSave`) before the transfer thread did and gather its stores
        on the engine's stream now; the thread sends them. False: the thread holds it (wait for
        it). Without fence words the claim only records an event for the thread's gathers to
        follow, and False is returned too."""
        posted = s.posted
        if not posted.claim("engine", blocking=False):
            return False
        try:
            posted.staged = self.mover.sender.stage_saves(s.stores, posted.stream)
            if posted.staged is None:
                posted.event_here()
        finally:
            posted.lock.release()
        self.stats["saves_gathered_by_bind"] += 1
        # the thread does not get to the saves before the next forward (an engine that never
        # waits for the GPU between steps): the next ones are gathered in wait_for_save, which
        # costs less than here, and the thread is tried again after them
        self._gather_in_wait = self._gather_retry
        self._gather_retry = min(2 * self._gather_retry, GATHER_IN_WAIT_RETRY_MAX)
        return posted.staged is not None

    def handle_preemptions(self, meta: KVDepotMetadata) -> None:
        """Before the forward that reuses preempted requests' blocks: their queued stores are
        dropped; the engine's stream waits for gathers already queued; a store the daemon reads
        from the blocks itself (no staging) is waited for."""
        if not isinstance(meta, KVDepotMetadata) or not meta.preempted or not self._active:
            return
        gone = set(meta.preempted)
        p = self.mover.preempt(gone, self.cfg.rpc_timeout_s + 1.0)
        if p.event is not None:
            self._current_stream().wait_event(p.event)
            if self._sliding_saves:  # handled before the preemption: p.event follows their gathers
                self.mover.forget_gathered(self._sliding_saves[-1].seq)
                self._sliding_saves = []

    def _engine_event(self):
        """CUDA: an event recorded on the engine's current stream now (None on CPU)."""
        stream = self._stream_now()
        if stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def _stream_now(self):
        """CUDA: the engine's current stream, for the transfer thread to record an event on when
        it takes the command (`TransferThread._handle`); None on CPU."""
        return self._current_stream() if self._cuda else None

    def start_load_kv(self, forward_context=None, **kwargs) -> None:
        """vLLM's call after the forward's launch: the step's loads went out in
        `bind_connector_metadata` already; only loads it did not see (a caller that skipped it)
        go out here."""
        meta = self._meta
        if meta is not None and meta.loads and meta is not self._loads_started:
            self._start_loads(meta)

    def _start_loads(self, meta: KVDepotMetadata) -> None:
        """Record an event on the engine's stream now (the loads' scatters follow everything
        queued on it so far: earlier owners' work on the blocks, vLLM's zeroing of them) and
        hand the step's loads to the transfer thread (at once: a load wakes it)."""
        self._loads_started = meta
        if self._active:
            self.mover.post(cmds.Load(meta.loads, meta.null_block_id, self._engine_event()))

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or not meta.stores or not self._active or not self.stores_chunks:
            if meta is not None and getattr(meta, "pin_seq", 0):
                self._saves_ended.add(meta.pin_seq)  # never sent: nothing reads its blocks
            return
        self._saves_posted += 1
        # the step's finished requests go with its save (one wake-up of the transfer thread
        # instead of two; `get_transfer_results` posts them where a step saves nothing). Taken
        # last in each command, so that a call that raises before the post leaves them to
        # `get_transfer_results`
        if self.stores_may_wait:
            # the blocks stay the request's until its stores ended (sliding-window blocks: pinned
            # by the scheduler until the save ended, `pin_seq`), so the gathers may follow a
            # later point of the engine's stream than this one: the transfer thread records the
            # event when it takes the save (an event made and recorded here cost the engine
            # thread 25-36 us per store step on an H100, most of it waiting for the GIL back).
            # The most common step of all that move something: one call here, inline
            stream = self._current_stream() if self._cuda else None
            release = meta.release  # (`_take_release`, inline; after anything that may raise)
            if release and meta is not self._released:
                self._released = meta
            else:
                release = None
            self._post_quiet(cmds.SaveOnStream(meta.stores, release, stream, meta.pin_seq))
            return
        take = self._take_release
        if self._cuda:
            if self._gather_in_wait > 0:
                # gathered now on the engine's stream where the ring's fence words are in use:
                # nothing for `bind_connector_metadata` to wait for (after `bind_connector_metadata` had to gather one itself)
                self._gather_in_wait -= 1
                staged = self.mover.sender.stage_saves(meta.stores, self._current_stream())
                if staged is not None:
                    self.mover.post(cmds.SaveStaged(meta.stores, take(meta), staged))
                    return
            else:
                # sliding-window models: gathered on the engine's stream by the transfer thread
                # when it takes the save (while the engine waits for the GPU), or by `bind_connector_metadata` if a
                # forward may write one of their blocks before then (`PostedSave`); the engine
                # thread's gather call cost it 100-250 us per store step on the GPU hosts measured
                posted = PostedSave(self._current_stream())
                self.mover.post(cmds.SavePosted(meta.stores, take(meta), posted))
                self._sliding_saves.append(_SlidingSave(self._saves_posted, meta.stores, posted))
                return
        # the release taken last: a call that raises before it leaves them to `get_transfer_results`
        self.mover.post(cmds.SaveAfterEvent(meta.stores, event=self._engine_event(), release=take(meta)))
        self._sliding_saves.append(_SlidingSave(self._saves_posted, meta.stores))

    def _take_release(self, meta: KVDepotMetadata):
        """The step's finished requests (``meta.release``) the first time they are asked for,
        else None: each step's releases are posted once, after its save."""
        if not meta.release or meta is self._released:
            return None
        self._released = meta
        return meta.release

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM's older call (`get_transfer_results` without failed_recving)."""
        res = self.get_transfer_results(finished_req_ids)
        return res.finished_sending or None, res.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str] | None = None) -> KVConnectorTransferResults:
        """This step's finished_sending, finished_recving and failed_recving (vLLM's
        ``KVConnectorTransferResults``); never waits. The engine's stream waits for the
        scatters of the loads reported. Most steps end nothing: then `NO_RESULTS` (one shared
        result of empty frozensets, which vLLM only reads: building one cost a decode step 6-7
        us of cold caches on the dev VM)."""
        if not self._active:
            return NO_RESULTS
        meta = self._meta
        # a step that saved posted its releases with the save; the others' go here (after any
        # save of theirs, so the stores are queued first). `_take_release`, inline: one call
        # less on every step
        if meta is not None and meta.release and meta is not self._released:
            self._released = meta
            self._post_quiet(cmds.Release(meta.release))
        box = self._outbox
        if not box:  # most steps: nothing ended
            return NO_RESULTS
        out = box.popleft()  # the usual one result; more are merged into it
        if box:
            out = self.mover.merge_rest(out)
        if out.scatter_event is not None:
            self._current_stream().wait_event(out.scatter_event)
        if out.invalid_blocks:
            self._invalid_blocks |= out.invalid_blocks
        if out.saves_ended:
            self._saves_ended |= out.saves_ended
        return out.transfer  # (built by the transfer thread over out's sets)

    def build_connector_worker_meta(self) -> KVDepotWorkerMeta | None:
        """The pinned saves that ended since the last call (vLLM's
        ``build_connector_worker_meta``, after ``get_finished`` in each step), or None."""
        if not self._saves_ended:
            return None
        ended, self._saves_ended = self._saves_ended, set()
        return KVDepotWorkerMeta({seq: 1 for seq in ended})

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of loads that failed since the last call (vLLM recomputes their requests);
        most steps the shared empty frozenset (`NOTHING_ENDED`)."""
        if not self._invalid_blocks:
            return NOTHING_ENDED[2]
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def _current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()``, without building a new Stream object (several
        microseconds) while the current stream stays the same one."""
        src = self._stream_src
        if src is None:  # once: the lookups below cost a few microseconds per call
            local = self.registrar.reg.local
            src = self._stream_src = (getattr(torch._C, "_cuda_getCurrentRawStream", None),
                                      local[0].device.index if local else None)
        raw_fn, dev = src
        if raw_fn is None or dev is None:
            return torch.cuda.current_stream()
        raw = raw_fn(dev)
        got = self._stream
        if got[0] != raw or got[1] is None:
            got = self._stream = (raw, torch.cuda.current_stream(dev))
        return got[1]

    def shutdown(self) -> None:
        self.mover.stop(self.cfg.rpc_timeout_s * 2 + 1.0)
        if self._shm is not None:
            self._shm.close()


class _SlidingSave:
    """A "save" posted for a sliding-window model whose gathers may not have run yet."""

    __slots__ = ("seq", "stores", "posted", "_blocks")

    def __init__(self, seq: int, stores, posted: PostedSave | None = None) -> None:
        self.seq = seq  # its number among the saves posted (1-based), `TransferThread.gathered`
        self.stores = stores  # its StoreJobs
        self.posted = posted  # CUDA: whoever claims it first gathers it on the engine's stream
        self._blocks: set[int] | None = None

    def blocks(self) -> set[int]:
        """Every manager block id its stores read (built on first use)."""
        if self._blocks is None:
            self._blocks = {b for job in self.stores for ids in job.block_ids for b in ids}
        return self._blocks


def written_set(written: list[int] | None, null_block_id: int | None) -> set[int] | None:
    """The scheduler's ``written_block_ids`` (a flat list, `kvdepot.client.vllm.scheduler.written_blocks`)
    as a set without vLLM's null block (never written, and sliding-window stores read it as
    "no block"); None stays None (every earlier store is waited for)."""
    if written is None:
        return None
    out = set(written)
    out.discard(null_block_id)
    return out


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
