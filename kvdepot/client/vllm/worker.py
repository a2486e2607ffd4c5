"""Worker side of the vLLM connector (one per GPU / CPU worker process).

Per step (order of vLLM's ``KVConnectorModelRunnerMixin``): ``bind_connector_metadata`` ->
forward -> ``start_load_kv`` (this connector's loads are asynchronous, so vLLM calls it after
the forward) -> ``wait_for_save`` -> ``get_transfer_results`` -> ``get_block_ids_with_load_errors``.

* Loads: one `Retrieve` per job, bounded by ``rpc_timeout_s``. CUDA: the daemon's copies are
  ordered before the next forward on the GPU (the current stream waits on the daemon's
  interprocess event). A job is reported in finished_recving in the same step; what was not
  retrieved is reported as failed (invalid blocks for single-group models, failed_recving for
  hybrid models), and vLLM recomputes it.
* Stores: one `Store` per job in ``wait_for_save``, after the step's forward (CUDA: the daemon
  waits on an interprocess event recorded on the current stream). Failures skip the store.
* A store or retrieve that timed out may still run in the daemon. Its request keeps its blocks
  (finished_recving / finished_sending withheld) until the daemon's late reply, a daemon
  restart (new boot id) or ``hold_max_s``.
* vLLM's null block: a sliding-window group's table holds it for tokens the group no longer
  needs. Stores only read it; a retrieve would write junk into it, so the worker saves its bytes
  before such a retrieve and writes them back after.
* Daemon down: every call fails fast; a ping every ``retry_interval_s``; on the first answer
  (and after any restart, detected by a new boot id or UNKNOWN_REGISTRATION) the worker
  registers again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Mapping

import torch

from kvdepot.client.vllm.channel import DaemonChannel
from kvdepot.client.vllm.config import ConnectorConfig
from kvdepot.client.vllm.layout import Registration, TransferGroup, build_registration
from kvdepot.client.vllm.plan import KVDepotMetadata, LoadJob, StoreJob
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError

log = logging.getLogger("kvdepot.vllm")


@dataclasses.dataclass(slots=True)
class _Late:
    """A store / retrieve that timed out and may still run in the daemon."""

    req_id: str
    generation: int  # channel boot generation when sent: a new one means the daemon died
    deadline: float  # give up waiting (monotonic)
    null_snapshot: dict[str, torch.Tensor] | None  # retrieve that could write the null block


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
        tp = vllm_config.parallel_config.tensor_parallel_size
        self.tp_rank = _tp_rank(tp)
        from kvdepot.client.hashing import shard_name

        self.shard = shard_name(self.tp_rank, tp)
        self.channel = DaemonChannel(cfg.endpoint, f"vllm-worker-{os.getpid()}-tp{self.tp_rank}",
                                     cfg.retry_interval_s)
        self.reg: Registration | None = None
        self._register_msg: m.Register | None = None
        self.registration_id: str | None = None
        self._reg_generation = -1
        self._meta: KVDepotMetadata | None = None
        self._recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._late: dict[int, _Late] = {}  # rid -> timed-out op
        self._withheld: set[str] = set()  # loads done but whose retrieve may still run in the daemon
        self._release: set[str] = set()  # finished requests vLLM keeps blocks for
        self.stats = {"loads": 0, "load_failures": 0, "loaded_chunks": 0, "stores": 0, "stored_chunks": 0,
                      "store_failures": 0, "null_block_guards": 0}

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
        self._register_msg = m.Register(
            rid=0, model=self.model_id, shard=self.shard, chunk_size=self.cfg.chunk_size,
            storages=self.reg.storages, layers=self.reg.layers, groups=self.reg.groups, pid=os.getpid(),
            device=self.reg.device)
        self._register()

    def _disable(self, why: str) -> None:
        log.error("kvdepot: connector disabled on this worker (vLLM keeps serving without it): %s", why)
        self.disabled_reason = why
        self.registration_id = None

    def _register(self) -> bool:
        try:
            reply = self.channel.call(self._register_msg, self.cfg.rpc_timeout_s)
        except KVDepotError as exc:
            if exc.code in (ErrorCode.TIMEOUT, ErrorCode.INTERNAL):
                log.warning("kvdepot: registration failed (%s); retrying while the daemon is reachable", exc)
                self.channel.mark_down()
            else:
                self._disable(f"the daemon refused the KV-cache registration: {exc}")
            return False
        if reply.layout_fingerprint != self.fingerprint:
            self._disable(f"layout fingerprint {reply.layout_fingerprint} differs from the scheduler's "
                          f"{self.fingerprint}: chunk keys would name other bytes")
            return False
        self.registration_id = reply.registration
        self._reg_generation = self.channel.boot_generation
        log.info("kvdepot: registered %d layers as %s (%d bytes per chunk)", len(self.reg.layers),
                 reply.registration, reply.object_bytes)
        return True

    def _ready(self) -> bool:
        """Registered with a live daemon (registers again after a restart); never blocks long."""
        if self.disabled_reason or self._register_msg is None:
            return False
        if not self.channel.probe():
            return False
        if self.registration_id is None or self._reg_generation != self.channel.boot_generation:
            self.registration_id = None
            return self._register()
        return True

    # ------------------------------------------------------------------ per step

    def bind(self, meta: KVDepotMetadata) -> None:
        self._meta = meta
        self._release.update(meta.release)
        self._ready()  # once per step: notices a restarted daemon even while idle (never waits)

    def start_load_kv(self) -> None:
        meta = self._meta
        if meta is None or not meta.loads:
            return
        ready = self._ready()
        for job in meta.loads:
            self._load(job, ready, meta.null_block_id)

    def _load(self, job: LoadJob, ready: bool, null_id: int) -> None:
        self.stats["loads"] += 1
        c = self.cfg.chunk_size
        keys = job.keys[self.tp_rank] if job.keys else []
        retrieved = 0
        late = False
        if ready and keys and all(job.block_ids):
            reg = self.reg
            snapshot = self._null_snapshot(job, null_id)
            req = m.Retrieve(rid=0, registration=self.registration_id, keys=list(keys),
                             block_ids=[reg.expand(g, ids) for g, ids in enumerate(job.block_ids)],
                             skip_tokens=job.skip_tokens, request=job.req_id)
            try:
                reply = self._call_retrying(req, job.req_id, snapshot)
            except KVDepotError as exc:
                log.warning("kvdepot: load of request %s failed (it is recomputed): %s", job.req_id, exc)
                reply = None
            else:
                late = reply is None  # timed out: may still write the blocks
            if isinstance(reply, m.RetrieveReply):
                retrieved = reply.retrieved
                if reply.event and reg.device == "cuda":
                    _wait_ipc_event(reply.event)
            if snapshot is not None and not late:
                _restore(reg, null_id, snapshot)
        self.stats["loaded_chunks"] += retrieved
        loaded_end = (job.first_chunk + retrieved) * c if retrieved else job.local_tokens
        if loaded_end < job.end_tokens:
            self.stats["load_failures"] += 1
            self._fail_load(job, max(loaded_end, job.local_tokens))
        if late:
            self._withheld.add(job.req_id)  # reported once the daemon answered, restarted or hold_max_s passed
        else:
            self._recving.add(job.req_id)

    def _call_retrying(self, req: m.Msg, req_id: str, snapshot=None) -> m.Msg | None:
        try:
            return self._call_once(req, req_id, snapshot)
        except KVDepotError as exc:
            if exc.code != ErrorCode.UNKNOWN_REGISTRATION:
                raise
            log.warning("kvdepot: the daemon lost registration %s (restarted?); registering again",
                        self.registration_id)
            self.registration_id = None
            if not self._register():
                raise
            req.registration = self.registration_id
            return self._call_once(req, req_id, snapshot)

    def _call_once(self, req: m.Msg, req_id: str, snapshot=None) -> m.Msg | None:
        rid, reply = self.channel.call_tracked(req, self.cfg.rpc_timeout_s)
        if rid is None:
            raise KVDepotError(ErrorCode.TIMEOUT, "the daemon is unreachable")
        if reply is None:
            gen = self.channel.sent_generation(rid)
            self._late[rid] = _Late(req_id, self.channel.boot_generation if gen is None else gen,
                                    time.monotonic() + self.cfg.hold_max_s, snapshot)
        return reply

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

    def _null_snapshot(self, job: LoadJob, null_id: int) -> dict[str, torch.Tensor] | None:
        """Bytes of vLLM's null block, if this retrieve would write it."""
        hit = False
        for g, ids in zip(self.groups, job.block_ids):
            if not g.has_null_blocks:
                continue
            per_block = g.block_size
            first_written = job.skip_tokens // per_block
            if null_id in ids[first_written:]:
                hit = True
                break
        if not hit:
            return None
        self.stats["null_block_guards"] += 1
        if self.reg.device == "cuda":
            torch.cuda.current_stream().synchronize()  # no forward may read the null block meanwhile
        snap = {}
        for name, view in self.reg.views.items():
            r = view.shape[0] // self.kv_cache_config.num_blocks if self.kv_cache_config.num_blocks else 1
            snap[name] = view[null_id * r:(null_id + 1) * r].clone()
        return snap

    def wait_for_save(self) -> None:
        meta = self._meta
        if meta is None or not meta.stores:
            return
        ready = self._ready()
        for job in meta.stores:
            self._store(job, ready)

    def _store(self, job: StoreJob, ready: bool) -> None:
        keys = job.keys[self.tp_rank]
        if not ready or not keys:
            self.stats["store_failures"] += 1
            return
        reg = self.reg
        event = _record_ipc_event() if reg.device == "cuda" else b""
        req = m.Store(rid=0, registration=self.registration_id, keys=list(keys),
                      block_ids=[reg.expand(g, ids) for g, ids in enumerate(job.block_ids)],
                      parent=job.parents[self.tp_rank], cache_salt=job.cache_salt, request=job.req_id, event=event)
        try:
            reply = self._call_retrying(req, job.req_id)
        except KVDepotError as exc:
            log.warning("kvdepot: store of request %s skipped: %s", job.req_id, exc)
            self.stats["store_failures"] += 1
            return
        if isinstance(reply, m.StoreReply):
            self.stats["stores"] += 1
            self.stats["stored_chunks"] += reply.stored
        else:
            self.stats["store_failures"] += 1

    def _resolve_late(self) -> None:
        if not self._late:
            return
        self.channel.poll(0)
        now = time.monotonic()
        for rid, op in list(self._late.items()):
            reply = self.channel.take(rid)
            gone = self.channel.boot_generation != op.generation
            if reply is None and not gone and now < op.deadline:
                continue
            if reply is None and not gone:
                log.warning("kvdepot: no late answer for request %s after %.0f s; releasing its blocks",
                            op.req_id, self.cfg.hold_max_s)
            self.channel.forget(rid)
            del self._late[rid]
            if op.null_snapshot is not None:
                _restore(self.reg, self._null_id(), op.null_snapshot)

    def _null_id(self) -> int:
        return self._meta.null_block_id if self._meta is not None else 0

    def _busy(self, req_id: str) -> bool:
        return any(op.req_id == req_id for op in self._late.values())

    def get_transfer_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) of this step."""
        self._resolve_late()
        for req_id in list(self._withheld):
            if not self._busy(req_id):
                self._withheld.discard(req_id)
                self._recving.add(req_id)
        sending = {r for r in self._release if not self._busy(r) and r not in self._withheld}
        self._release -= sending
        recving, self._recving = self._recving, set()
        failed, self._failed_recving = self._failed_recving & recving, self._failed_recving - recving
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def shutdown(self) -> None:
        if self.registration_id is not None and self.channel.up:
            try:
                self.channel.call(m.Unregister(rid=0, registration=self.registration_id), 1.0)
            except KVDepotError:
                pass
        self.channel.close()


def _tp_rank(tp_size: int) -> int:
    if tp_size == 1:
        return 0
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _restore(reg: Registration | None, null_id: int, snap: dict[str, torch.Tensor]) -> None:
    if reg is None:
        return
    for name, saved in snap.items():
        view = reg.views[name]
        r = saved.shape[0]
        view[null_id * r:(null_id + 1) * r].copy_(saved)


_events: dict = {}


def _record_ipc_event() -> bytes:
    """Record an interprocess CUDA event on the current stream (after this step's forward);
    the daemon's copy waits on it."""
    stream = torch.cuda.current_stream()
    # one event per stream: a wait sees the event's latest record, which covers an earlier
    # outstanding store only when recorded later on the same stream
    key = ("own", stream.cuda_stream)
    got = _events.get(key)
    if got is None:
        with torch.cuda.device(stream.device):
            ev = torch.cuda.Event(interprocess=True)
        got = _events[key] = (ev, bytes(ev.ipc_handle()))
    got[0].record(stream)
    return got[1]


def _wait_ipc_event(handle: bytes) -> None:
    """Make the current stream wait (on the GPU) for the daemon's retrieve copies."""
    stream = torch.cuda.current_stream()
    ev = _events.get(("peer", handle))
    if ev is None:
        ev = _events[("peer", handle)] = torch.cuda.Event.from_ipc_handle(stream.device, handle)
    stream.wait_event(ev)
