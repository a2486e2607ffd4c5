"""Worker side of the vLLM connector (one per GPU / CPU worker process): a thin adapter over
`kvdepot.client.KVDepotClient`. Nothing on the step path waits for the daemon.

Per step (order of vLLM's ``KVConnectorModelRunnerMixin``): ``handle_preemptions`` ->
``bind_connector_metadata`` -> ``start_load_kv`` -> forward -> ``wait_for_save`` ->
``get_finished`` -> ``get_block_ids_with_load_errors``.

* Loads (``start_load_kv``): every retrieve of the step is submitted, none waited for. CUDA
  engines gather and scatter in this process on the engine's stream through a device staging
  ring (engine-side staging, `kvdepot.client.staging`): the daemon copies the chunks into the
  ring and replies with its event; ``get_finished`` and, during a forward, ``save_kv_layer``
  query that event (never wait on it), enqueue the scatter on the current stream once it
  completed (so the next forward on that stream reads the blocks after it), and the request is
  reported in finished_recving. What was not
  retrieved is reported as failed (invalid blocks for single-group models, failed_recving for
  hybrid ones) and vLLM recomputes it. vLLM's null block (which a sliding-window group's table
  holds for tokens outside the window) is left out of the scatter (block id -1).
* Stores (``wait_for_save``, after the forward): CUDA: the chunks are gathered into the ring on
  the current stream, and the `Store` is sent; its reply is collected in a later
  ``get_finished``. CPU: the daemon reads the shared-memory blocks itself. A finished request
  keeps its blocks (vLLM's ``delay_free_blocks``) until its stores and loads ended, then is
  reported in finished_sending.
* Ring full: a store or load waits in a queue (in order, so a request's chunks reach the
  daemon parent first) and goes out in a later call once the ring has room. For models with a
  sliding-window group a store never waits (vLLM frees blocks that leave the window while the
  request runs): it is skipped and counted. A load or store larger than a quarter of the ring
  goes in pieces.
* Daemon down, hung or restarted: see `kvdepot.client.client` (fail fast, `available` probes,
  a new boot -> register again). A store or retrieve without an answer after ``rpc_timeout_s``
  marks the daemon down (no new ones); its request keeps its blocks until the answer, the
  daemon's restart or ``hold_max_s``, so a late copy never touches blocks vLLM gave to another
  request.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Mapping

import torch

from kvdepot.client.client import KVDepotClient, PendingRetrieve, PendingStore
from kvdepot.client.hashing import shard_keys, shard_mask, shard_name
from kvdepot.client.vllm.config import ConnectorConfig
from kvdepot.client.vllm.layout import Registration, TransferGroup, build_registration
from kvdepot.client.vllm.plan import KVDepotMetadata, LoadJob
from kvdepot.protocol.errors import ErrorCode, KVDepotError

log = logging.getLogger("kvdepot.vllm")

_LAYER_PUMP_INTERVAL_S = 100e-6  # between two `WorkerSide.on_layer` pumps
_LAYER_PUMP_IDLE_S = 1e-3  # ... and at most this long without one while no reply came
# errors after which the daemon is treated as down (pinged until it answers) rather than as
# having refused one request
_DOWN = (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE, ErrorCode.DISCONNECTED, ErrorCode.INTERNAL)


@dataclasses.dataclass(slots=True)
class _Piece:
    """Up to a quarter of the staging ring of one store or load job."""

    req_id: str
    kind: str  # "store" / "load"
    keys: list[bytes]  # this shard's keys
    block_ids: list[list[int]]  # per daemon gid, registered (kernel) block ids
    parent: bytes = b""  # store: key of the chunk before
    cache_salt: str = ""
    skip_tokens: int = 0  # load
    load: _Load | None = None  # load: the job it belongs to
    index: int = 0  # load: piece number within the job
    queued_at: float = 0.0
    waited: bool = False  # found the staging ring full at least once (counted in pieces_queued)


@dataclasses.dataclass(slots=True)
class _Load:
    """A load job in flight: reported once every piece ended."""

    job: LoadJob
    retrieved: list[int | None]  # per piece: chunks written (None: not ended yet)
    chunks: list[int]  # per piece: chunks asked for


@dataclasses.dataclass(slots=True)
class _Op:
    piece: _Piece
    pending: PendingStore | PendingRetrieve
    generation: int  # the client's boot generation when sent
    sent_at: float
    late: bool = False  # rpc_timeout_s passed (logged, daemon marked down)


class WorkerSide:
    """State and logic of a WORKER-role connector."""

    def __init__(self, cfg: ConnectorConfig, vllm_config, kv_cache_config, groups: list[TransferGroup],
                 fingerprint: str, model_id: str, disabled_reason: str) -> None:
        self.cfg = cfg
        self.kv_cache_config = kv_cache_config
        self.groups = groups
        self.fingerprint = fingerprint
        self.model_id = model_id
        self.disabled_reason = disabled_reason
        self.single_group = len(kv_cache_config.kv_cache_groups) == 1
        # a store may wait for ring room only where vLLM never frees a running request's blocks
        self.stores_may_wait = not any(g.has_null_blocks for g in groups)
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = _tp_rank(tp)
        self.shard = shard_name(self.tp_rank, tp)
        self.client = KVDepotClient(cfg.endpoint, timeout_s=cfg.rpc_timeout_s,
                                    name=f"vllm-worker-{os.getpid()}-tp{self.tp_rank}", connect=False,
                                    retry_interval_s=cfg.retry_interval_s)
        self.reg: Registration | None = None  # what vLLM's caches look like
        self.kvreg = None  # the client's Registration (None: not registered with the live daemon)
        self._reg_generation = -1
        self._meta: KVDepotMetadata | None = None
        self._queue: collections.deque[_Piece] = collections.deque()  # waiting for ring room
        self._ops: list[_Op] = []
        self._stopped: set[str] = set()  # requests whose later stores are skipped (a chunk was)
        self._masks: dict[bytes, bytes] = {}  # request seed -> this shard's mask
        self._recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._release: set[str] = set()  # finished requests vLLM keeps blocks for
        self._loads_out = 0  # load pieces sent whose scatter is not enqueued yet
        self._layer_pump_s = 0.0  # time.monotonic() of the last `on_layer` pump
        self._replies_at_pump = -1  # the client's replies_read at the last pump
        self._stream: tuple[int, torch.cuda.Stream | None] = (0, None)  # (raw pointer, the current stream)
        self.stats = {"loads": 0, "load_failures": 0, "loaded_chunks": 0, "stores": 0, "stored_chunks": 0,
                      "store_failures": 0, "stores_skipped_ring_full": 0, "pieces_queued": 0, "late_ops": 0,
                      "null_blocks_left_alone": 0, "pieces_sent_mid_forward": 0}

    @property
    def registration_id(self) -> str | None:
        """The daemon's id of this worker's registration, while it is current."""
        ok = self.kvreg is not None and self._reg_generation == self.client.generation
        return self.kvreg.id if ok else None

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if self.disabled_reason:
            log.warning("kvdepot: connector disabled: %s", self.disabled_reason)
            return
        try:
            self.reg = build_registration(kv_caches, self.kv_cache_config, self.groups)
        except ValueError as exc:
            self._disable(str(exc))
            return
        self._register()

    def _disable(self, why: str) -> None:
        log.error("kvdepot: connector disabled on this worker (vLLM keeps serving without it): %s", why)
        self.disabled_reason = why
        self.kvreg = None

    def _register(self) -> bool:
        reg, c = self.reg, self.client
        try:
            if self.kvreg is not None:
                new = c.reregister(self.kvreg)
            else:
                new = c.register(self.model_id, self.shard, self.cfg.chunk_size, reg.storages, reg.layers, reg.groups,
                                 device=reg.device, local_storages=reg.local if reg.device == "cuda" else None,
                                 staging_bytes=self.cfg.staging_bytes, storage_fds=reg.storage_fds)
        except KVDepotError as exc:
            if exc.code in _DOWN:
                log.warning("kvdepot: registration failed (%s); retrying while the daemon is reachable", exc)
                c.mark_down()
            else:
                self._disable(f"the daemon refused the KV-cache registration: {exc}")
            return False
        if new.layout_fingerprint != self.fingerprint:
            self._disable(f"layout fingerprint {new.layout_fingerprint} differs from the scheduler's "
                          f"{self.fingerprint}: chunk keys would name other bytes")
            return False
        self.kvreg = new
        self._reg_generation = c.generation
        log.info("kvdepot: registered %d layers as %s (%d bytes per chunk%s)", len(reg.layers), new.id,
                 new.object_bytes, ", engine-side staging" if new.staging is not None else "")
        return True

    def _ready(self) -> bool:
        """Registered with a live daemon (registers again after a restart); never blocks long."""
        if self.disabled_reason or self.reg is None:
            return False
        c = self.client
        if not c.available():
            return False
        if self.kvreg is not None and not c.connected:
            # the daemon closed the connection: a restarted one would not know the registration.
            # One round trip on the new connection learns its boot id (then generation says).
            try:
                c.ping()
            except KVDepotError as exc:
                log.warning("kvdepot: the daemon does not answer (%s)", exc)
                c.mark_down()
                return False
        if self.kvreg is None or self._reg_generation != c.generation:
            return self._register()
        return True

    # ------------------------------------------------------------------ per step

    def bind(self, meta: KVDepotMetadata) -> None:
        self._meta = meta
        self._release.update(meta.release)
        self._ready()  # once per step: notices a restarted daemon even while idle (never waits)

    def handle_preemptions(self, meta: KVDepotMetadata) -> None:
        """Before the forward that reuses preempted requests' blocks: their queued stores are
        dropped; a store the daemon reads from the blocks itself (no staging) is waited for."""
        gone = set(meta.preempted) if isinstance(meta, KVDepotMetadata) else set()
        if not gone:
            return
        kept = collections.deque()
        for p in self._queue:
            if p.req_id in gone and p.kind == "store":
                self.stats["store_failures"] += 1
                self._stopped.add(p.req_id)
            else:
                kept.append(p)
        self._queue = kept
        for op in self._ops:
            if op.piece.req_id in gone and op.piece.kind == "store" and op.pending._region is None:
                try:
                    op.pending.result(timeout_s=self.cfg.rpc_timeout_s)
                except KVDepotError as exc:
                    log.error("kvdepot: store of preempted request %s did not end (%s); its blocks are reused now",
                              op.piece.req_id, exc)
        self._collect()

    def _keys(self, chain: list[bytes], seed: bytes) -> list[bytes]:
        mask = self._masks.get(seed)
        if mask is None:
            if len(self._masks) > 4096:
                self._masks.clear()
            mask = self._masks[seed] = shard_mask(seed, self.shard)
        return shard_keys(chain, [mask])[0]

    def _piece_chunks(self) -> int:
        """Most chunks per piece: a quarter of the ring, so that several are in flight."""
        kvreg = self.kvreg
        if kvreg is None or kvreg.staging is None:
            return 1 << 30
        return max(1, kvreg.staging.ring.size_bytes // 4 // kvreg.object_bytes)

    def _block_ids(self, g: int, ids: list[int], null_id: int | None) -> list[int]:
        """Manager block ids of daemon gid ``g`` -> registered block ids; ``null_id`` -> -1."""
        r = self.reg.ratio[g]
        if null_id is not None and self.groups[g].has_null_blocks and null_id in ids:
            self.stats["null_blocks_left_alone"] += 1
            return [-1 if b == null_id else b * r + i for b in ids for i in range(r)]
        return self.reg.expand(g, ids)

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or not meta.loads:
            return
        ready = self._ready()
        for job in meta.loads:
            self._load(job, ready, meta.null_block_id)
        self._pump()

    def _load(self, job: LoadJob, ready: bool, null_id: int) -> None:
        self.stats["loads"] += 1
        if not (ready and job.chain and all(job.block_ids)):
            self._finish_load(job, 0)
            return
        keys = self._keys(job.chain, job.seed)
        c = self.cfg.chunk_size
        per = self._piece_chunks()
        ids = [self._block_ids(g, b, null_id) for g, b in enumerate(job.block_ids)]
        bpc = [c // gs.tokens_per_block for gs in self.reg.groups]
        starts = list(range(0, len(keys), per))
        load = _Load(job, [None] * len(starts), [min(per, len(keys) - s) for s in starts])
        now = time.monotonic()
        for i, s in enumerate(starts):
            e = s + load.chunks[i]
            self._queue.append(_Piece(job.req_id, "load", keys[s:e], [x[s * n:e * n] for x, n in zip(ids, bpc)],
                                      skip_tokens=job.skip_tokens if i == 0 else 0, load=load, index=i,
                                      queued_at=now))

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or not meta.stores:
            return
        ready = self._ready()
        c = self.cfg.chunk_size
        per = self._piece_chunks()
        now = time.monotonic()
        for job in meta.stores:
            if not ready or job.req_id in self._stopped or not job.chain:
                self.stats["store_failures"] += 1
                continue
            keys = self._keys(job.chain, job.seed)
            parent = self._keys([job.parent], job.seed)[0] if job.parent else b""
            ids = [self._block_ids(g, b, None) for g, b in enumerate(job.block_ids)]
            bpc = [c // gs.tokens_per_block for gs in self.reg.groups]
            for s in range(0, len(keys), per):
                e = min(len(keys), s + per)
                self._queue.append(_Piece(job.req_id, "store", keys[s:e], [x[s * n:e * n] for x, n in zip(ids, bpc)],
                                          parent=parent if s == 0 else keys[s - 1], cache_salt=job.cache_salt,
                                          queued_at=now))
        self._pump(stores_now=True)

    def layer_calls_wanted(self) -> bool:
        """Whether `on_layer` has anything to do: pieces wait for staging-ring room, or loads
        are in flight (their scatters are enqueued as their copies end)."""
        return bool(self._queue) or self._loads_out > 0

    def on_layer(self) -> None:
        """One attention layer of the forward is done (vLLM's ``save_kv_layer``). Loads whose
        copies into the ring ended get their scatter enqueued (on the current stream: the
        blocks belong to requests waiting for their KV, which this forward does not touch), and
        pieces waiting for staging-ring room are sent, now rather than at the next step's
        connector calls: a forward (tens of ms for a batch with a long prefill) lasts far longer
        than the ring's bytes take on the link, so a ring refilled only once per step would cap
        stores and loads at a ring per step. Never while a CUDA graph is being captured (work
        launched then would be recorded into the graph); at most every
        ``_LAYER_PUMP_INTERVAL_S``."""
        if not self._queue and self._loads_out <= 0:
            return
        now = time.monotonic()
        if now - self._layer_pump_s < _LAYER_PUMP_INTERVAL_S:
            return
        self.client.poll()
        if now - self._layer_pump_s < _LAYER_PUMP_IDLE_S and not self._pump_due():
            return
        if self.reg is not None and self.reg.device == "cuda" and torch.cuda.is_current_stream_capturing():
            return
        self._layer_pump_s = now
        waiting = len(self._queue)
        self._pump()
        self.stats["pieces_sent_mid_forward"] += waiting - len(self._queue)

    def _pump_due(self) -> bool:
        """Whether a pump would find work, judged without one: a reply came since the last pump
        (a store ended, or a load's copies were enqueued), the oldest load's copies into the
        ring ended (its scatter is due; a registration's retrieves end in order), or the ring's
        oldest region is free (a queued piece may fit)."""
        if self.client.replies_read != self._replies_at_pump:
            return True
        for op in self._ops:
            if op.piece.kind == "load":
                if op.pending.done():
                    return True
                break
        if self._queue and self.kvreg is not None and self.kvreg.staging is not None:
            live = self.kvreg.staging.ring.live
            return bool(live) and live[0].is_free()
        return False

    def _pump(self, stores_now: bool = False) -> None:
        """Send queued pieces, in order, while the staging ring has room (never waits for it).
        ``stores_now``: this step's stores must be gathered now or never (sliding-window models)."""
        if not self._queue:
            return
        self.client.poll()
        self._replies_at_pump = self.client.replies_read
        self._collect()
        kvreg, c = self.kvreg, self.client
        stream = self._current_stream() if self.reg is not None and self.reg.device == "cuda" else None
        while self._queue:
            p = self._queue[0]
            if kvreg is None or self._reg_generation != c.generation or not c.up:
                self._drop(self._queue.popleft(), "the daemon is not available")
                continue
            if p.kind == "store" and p.req_id in self._stopped:
                self._queue.popleft()
                self.stats["store_failures"] += 1
                continue
            try:
                if p.kind == "store":
                    pending = c.submit_store(kvreg, p.keys, p.block_ids, p.parent, p.cache_salt, p.req_id,
                                             after=stream, wait_for_room=False)
                else:
                    pending = c.submit_retrieve(kvreg, p.keys, p.block_ids, p.skip_tokens, p.req_id,
                                                wait_for_room=False)
            except KVDepotError as exc:
                if exc.code in _DOWN:
                    c.mark_down()
                self._drop(self._queue.popleft(), str(exc))
                continue
            if pending is None:  # no room in the ring now
                if p.kind == "store" and (stores_now and not self.stores_may_wait):
                    self._queue.popleft()
                    self.stats["stores_skipped_ring_full"] += 1
                    self._stopped.add(p.req_id)
                    continue
                if time.monotonic() - p.queued_at > self.cfg.rpc_timeout_s:
                    self._queue.popleft()  # the daemon drains the ring too slowly
                    if p.kind == "store":
                        self.stats["stores_skipped_ring_full"] += 1
                        self._stopped.add(p.req_id)
                    else:
                        self._piece_ended(p, 0)  # recomputed
                    continue
                if not p.waited:  # a piece waits once however many pumps find the ring still full
                    p.waited = True
                    self.stats["pieces_queued"] += 1
                break
            self._queue.popleft()
            self._ops.append(_Op(p, pending, c.generation, time.monotonic()))
            self._loads_out += p.kind == "load"

    def _current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream()``, without building a new Stream object (several
        microseconds) while the current stream stays the same one."""
        raw_fn = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw_fn is None:
            return torch.cuda.current_stream()
        dev = self.reg.local[0].device.index if self.reg.local else None
        if dev is None:
            return torch.cuda.current_stream()
        raw = raw_fn(dev)
        got = self._stream
        if got[0] != raw or got[1] is None:
            got = self._stream = (raw, torch.cuda.current_stream(dev))
        return got[1]

    def _drop(self, p: _Piece, why: str) -> None:
        if p.kind == "store":
            self.stats["store_failures"] += 1
            self._stopped.add(p.req_id)
            log.debug("kvdepot: store of request %s skipped: %s", p.req_id, why)
        else:
            self._piece_ended(p, 0)

    def _collect(self) -> None:
        """End the ops whose answer is in (never waits); give up on those of a daemon that
        restarted or after ``hold_max_s``."""
        if not self._ops:
            self._loads_out = 0
            return
        now = time.monotonic()
        c = self.client
        left = []
        for op in self._ops:
            p = op.piece
            age_s = now - op.sent_at
            if op.pending.done():
                try:
                    if p.kind == "store":
                        r = op.pending.result()
                        self.stats["stores"] += 1
                        self.stats["stored_chunks"] += r.stored
                        if r.skipped:
                            self._stopped.add(p.req_id)
                    else:
                        got = op.pending.result(before=self._current_stream()
                                                if self.reg.device == "cuda" else None)
                        self._piece_ended(p, got)
                except KVDepotError as exc:
                    if (exc.code in (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED) and op.generation == c.generation
                            and age_s <= self.cfg.hold_max_s):
                        # lost with the connection, not refused: the daemon may still run it, so its
                        # blocks stay the request's until the daemon restarted or hold_max_s passed
                        if not op.late:
                            op.late = True
                            self.stats["late_ops"] += 1
                            c.mark_down()
                        left.append(op)
                        continue
                    self._failed_op(op, exc)
                continue
            if op.generation != c.generation or age_s > self.cfg.hold_max_s:
                if op.generation == c.generation:
                    log.warning("kvdepot: no answer for request %s after %.0f s; releasing its blocks",
                                p.req_id, age_s)
                self._failed_op(op, None)
                continue
            if age_s > self.cfg.rpc_timeout_s and not op.late:
                op.late = True
                self.stats["late_ops"] += 1
                log.warning("kvdepot: %s of request %s unanswered after %.1f s; the daemon is considered down",
                            p.kind, p.req_id, self.cfg.rpc_timeout_s)
                c.mark_down()
            left.append(op)
        self._ops = left
        self._loads_out = sum(op.piece.kind == "load" for op in left)

    def _failed_op(self, op: _Op, exc: KVDepotError | None) -> None:
        p = op.piece
        if exc is not None:
            if exc.code == ErrorCode.UNKNOWN_REGISTRATION:
                log.warning("kvdepot: the daemon lost registration %s (restarted?); registering again",
                            self.kvreg.id if self.kvreg else None)
                self._reg_generation = -1  # the next _ready() registers again
            elif exc.code in _DOWN:
                self.client.mark_down()
            log.warning("kvdepot: %s of request %s failed: %s", p.kind, p.req_id, exc)
        if p.kind == "store":
            self.stats["store_failures"] += 1
            self._stopped.add(p.req_id)
        else:
            self._piece_ended(p, 0)

    def _piece_ended(self, p: _Piece, retrieved: int) -> None:
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
        self._finish_load(load.job, total)

    def _finish_load(self, job: LoadJob, retrieved: int) -> None:
        c = self.cfg.chunk_size
        self.stats["loaded_chunks"] += retrieved
        loaded_end = (job.first_chunk + retrieved) * c if retrieved else job.local_tokens
        if loaded_end < job.end_tokens:
            self.stats["load_failures"] += 1
            self._fail_load(job, max(loaded_end, job.local_tokens))
        self._recving.add(job.req_id)

    def _fail_load(self, job: LoadJob, valid_end: int) -> None:
        """Report tokens ``[valid_end, job.end_tokens)`` as not loaded."""
        if self.single_group:
            g = self.groups[0]
            ids = job.fail_block_ids[0] if job.fail_block_ids else []
            first_block = job.local_tokens // g.block_size
            start = valid_end // g.block_size - first_block
            self._invalid_blocks.update(ids[max(start, 0):])
            if not ids:
                self._failed_recving.add(job.req_id)
        else:
            self._failed_recving.add(job.req_id)  # hybrid: vLLM takes failures per request only

    def _busy(self, req_id: str) -> bool:
        return any(op.piece.req_id == req_id for op in self._ops) or any(p.req_id == req_id for p in self._queue)

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this step; never waits."""
        self.client.poll()
        self._collect()
        self._pump()
        sending = {r for r in self._release if not self._busy(r)}
        self._release -= sending
        self._stopped -= sending
        recving, self._recving = self._recving, set()
        failed, self._failed_recving = self._failed_recving & recving, self._failed_recving - recving
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def shutdown(self) -> None:
        c = self.client
        if self.kvreg is not None and c.up:
            try:
                for op in self._ops:  # the ring and the blocks must outlive the daemon's copies
                    op.pending.result(timeout_s=self.cfg.rpc_timeout_s)
                c.unregister(self.kvreg)
            except KVDepotError:
                pass
        c.close()


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()
