"""The kvdepot daemon: a ZMQ ROUTER front end on one asyncio (uvloop) loop.

`Daemon` is composed of objects that each own their state and are passed what they use:

=========================  ===========================================  ===============================
object                      owns                                         module
=========================  ===========================================  ===============================
``front``                   sockets, stream connections, dispatch         `kvdepot.server.front`
``tiers``                   L1 (pool, chunk index), L2, L3, promotion     `kvdepot.server.tiering`
``lookups``                 lookups, their pins, lookup counters          `kvdepot.server.lookups`
``transfers``               STORE / RETRIEVE, copies, transfer counters   `kvdepot.server.transfers`
``settlements``             Drains and Settles of lost requests           `kvdepot.server.settle`
``watchdog``                copies in flight and their deadlines          `kvdepot.server.watchdog`
``liveness``                connections and reclaim of dead engines       `kvdepot.server.liveness`
=========================  ===========================================  ===============================

The daemon itself keeps the engine registry (register, unregister), start-up and shutdown,
describe and the health endpoints, and routes each request type to its handler.

The loop owns the socket, decoding, dispatch, the engine registry and the chunk index;
nothing on it blocks. Copies between engine memory and L1 run in a small thread pool
(torch releases the GIL inside copies) and their results are applied back on the loop.
Every request gets exactly one reply: its result or an `ErrorReply` with a typed code.
"""

from __future__ import annotations

import asyncio
import errno
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import zmq

import kvdepot
from kvdepot import trace
from kvdepot.gpu.cpu_engine import CpuTransferEngine
from kvdepot.gpu.layout import EngineLayout, group_layers
from kvdepot.gpu.shm import open_memfd, open_shm, shm_path
from kvdepot.protocol import codec
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.fdpass import fds_path
from kvdepot.protocol.transport import events_endpoint, ipc_path, make_socket, stream_path
from kvdepot.server.http import HttpEndpoints
from kvdepot.server.metrics import Metrics
from kvdepot.server.netsec import CurveConfig, TcpFront, check_endpoints
from kvdepot.server.pool import HostPool
from kvdepot.server.registration import Registration
from kvdepot.server.front import Front
from kvdepot.server.events import ChunkEvents
from kvdepot.server.faults import ENV_INJECT_FAULTS, InjectedFaults
from kvdepot.server.fdinbox import FdInbox
from kvdepot.server.gcpause import GENERATIONS, GcPauses, freeze_heap
from kvdepot.server.liveness import PeerLiveness
from kvdepot.server.lookups import Lookups
from kvdepot.server.settle import Settlements
from kvdepot.server.tiering import Tiers
from kvdepot.server.transfers import STORE_SKIP_REASONS, TransferService
from kvdepot.server.watchdog import CopyWatchdog

log = logging.getLogger("kvdepot.daemon")

_TICK_S = 1.0  # the event loop notes it is alive this often (/healthz)
_STALL_S = 10.0  # /healthz fails once the loop has not ticked for this long
# ErrorCode values only clients make up (never sent, never counted by the daemon)
_CLIENT_SIDE_CODES = (ErrorCode.TIMEOUT, ErrorCode.DISCONNECTED, ErrorCode.UNAVAILABLE, ErrorCode.BACKPRESSURE)


@dataclasses.dataclass
class DaemonConfig:
    """Settings of `kvdepot serve` (flags in parentheses)."""

    endpoints: list[str]  # (--endpoint, repeatable) ipc:// and/or tcp:// addresses
    l1_capacity_bytes: int = 4 << 30  # (--l1-bytes) L1 host pool size
    metrics_port: int = 0  # (--metrics-port) /metrics, /healthz, /readyz; 0 = no HTTP endpoint
    metrics_addr: str = "127.0.0.1"  # (--metrics-addr)
    pin_ttl_s: float = 120.0  # (--pin-ttl-s) lookup pins expire after this long
    liveness_interval_s: float = 1.0  # how often dead engines / expired pins are reclaimed
    # a stream client's registrations and pins are reclaimed once its connection has been closed
    # this long without a reconnect (kvdepot.server.liveness)
    peer_grace_s: float = 0.25
    watchdog_s: float = 30.0  # (--watchdog-s) floor of a copy's deadline (kvdepot.server.watchdog); 0 = off
    transfer_threads: int = 2  # (--transfer-threads) copy worker threads
    # (--allow-shm-names) CPU engines may register named /dev/shm segments, which they could
    # shrink under a copy (SIGBUS kills the daemon); else only sealed memfds
    allow_shm_names: bool = False
    staging_batch_bytes: int = 64 << 20  # (--staging-batch-bytes) device staging per slot (2 per direction per GPU)
    copy_piece_bytes: int = 8 << 20  # (--copy-piece-bytes) a larger chunk object moves in pieces; 0 = whole
    pin_l1: bool | None = None  # (--pin-l1/--no-pin-l1) page-lock L1 for DMA; None = if a GPU is visible
    # (--busy-poll-us) after each request or reply the loop polls its sockets without sleeping
    # for this long (one core busy while requests flow), so the next request is seen at once
    # instead of after a sleeping thread's wake-up (tens of microseconds on a VM); 0 = off
    busy_poll_us: int = 2000
    # (--busy-poll-max-inflight) ... only while at most this many copies are in flight: with more,
    # the copies queued on the link keep it busy through a wake-up (8 engines on an H200, 8 in
    # flight each: the same GB/s, the loop's thread 0.13-0.22 of a core instead of 0.98-1.01);
    # -1 = whatever is in flight
    busy_poll_max_inflight: int = 2
    # (--curve-secret-key, --curve-clients) CURVE authentication of tcp:// endpoints; without it
    # a tcp:// endpoint must be a loopback address (see kvdepot.server.netsec)
    curve: CurveConfig | None = None
    # (--l2-path, --l2-bytes, --l2-queue-bytes, --l2-io-threads, --l2-direct-io) the L2 disk
    # tier (kvdepot.server.disk); no path = none. queue None = min(2 GiB, L1 / 8)
    l2_path: str | None = None
    l2_capacity_bytes: int = 64 << 30
    l2_queue_bytes: int | None = None
    l2_io_threads: int = 4
    l2_direct_io: bool | None = None
    shutdown_drain_s: float = 30.0  # (--shutdown-drain-s) a clean stop writes L1 to L2 for at most this long
    # (--l3-url, --l3-cluster, --l3-prefix, --l3-ttl-s, --l3-timeout-s, --l3-queue-bytes) the L3
    # tier on Redis / Valkey (kvdepot.server.remote); no URL = none. queue None = min(1 GiB, L1 / 8)
    l3_url: str | None = None
    l3_cluster: bool = False
    l3_prefix: str = "kvdepot:"
    l3_ttl_s: float = 86400.0
    l3_timeout_s: float = 0.5
    l3_queue_bytes: int | None = None
    # (--tenant-quota SALT=BYTES, repeatable) most bytes of each tenant (cache_salt) in L1, and
    # the same share of L2 (kvdepot.server.quotas); "*": each salt not named
    tenant_quotas: dict[str, int] = dataclasses.field(default_factory=dict)


class Daemon:
    """The kvdepot daemon. Use ``await Daemon(cfg).serve()``; `stop` ends it."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.boot_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.metrics = Metrics()
        self._gc_pauses = GcPauses()
        for g, name in enumerate(GENERATIONS):
            self.metrics.gc_pause_seconds.set_function((name,), lambda g=g: self._gc_pauses.seconds[g])
        self.registrations: dict[str, Registration] = {}
        self._models: set[str] = set()  # every model ever registered (metric label values)
        self._cuda = None  # CudaRuntime, created by the first CUDA registration
        self.transfer_engine_name = CpuTransferEngine.name
        self._reg_seq = 0
        self._executor = ThreadPoolExecutor(config.transfer_threads, thread_name_prefix="kvdepot-xfer")
        self._stop = asyncio.Event()
        self._faults = InjectedFaults.from_env()  # soak tests only (kvdepot.server.faults)
        if self._faults is not None:
            log.warning("fault injection on (%s): %s", ENV_INJECT_FAULTS, self._faults)
        self.front = Front(self.metrics, lambda: len(self.watchdog.inflight), max(0, config.busy_poll_us) / 1e6,
                           config.busy_poll_max_inflight, self._faults, self._peer_attached, self._peer_detached)
        self.watchdog = CopyWatchdog(config.watchdog_s, self.metrics, self.front.reply_error)
        self.pool = HostPool(config.l1_capacity_bytes)
        self.events = ChunkEvents()  # chunks entering and leaving, for the connectors (opened in `serve`)
        self.tiers = Tiers(config, self.pool, self.metrics, self.front, self.events)
        self.index = self.tiers.index
        self.lookups = Lookups(self.tiers, self.index, self.front, self.metrics, self._model_label, config.pin_ttl_s)
        self.settlements = Settlements(self._registration, self.front)
        self.transfers = TransferService(self.registrations, self._registration, self.tiers, self.watchdog,
                                         self.settlements, self.front, self._executor,
                                         lambda dev: self._cuda.path(dev), self.metrics, self._faults)
        self.liveness = PeerLiveness(self.registrations, self.lookups, self._unregister, self.metrics,
                                     config.peer_grace_s)
        from kvdepot.gpu.kernels import kernels_source

        self.metrics.start(kvdepot.__version__, m.PROTOCOL_VERSION, kernels_source(), tiers=self.tiers.tier_names,
                           error_codes=[c.name for c in ErrorCode if c not in _CLIENT_SIDE_CODES],
                           skip_reasons=STORE_SKIP_REASONS, unsized=("l3",))
        self.front.route({
            m.Hello: self._on_hello, m.Ping: self._on_ping, m.Register: self._on_register,
            m.Unregister: self._on_unregister, m.Lookup: self.lookups.on_lookup, m.EndRequest: self.lookups.on_end,
            m.Store: self.transfers.on_store, m.Retrieve: self.transfers.on_retrieve,
            m.Drain: self.settlements.on_drain, m.Settle: self.settlements.on_settle,
            m.Flush: self.tiers.on_flush, m.Describe: self._on_describe,
        })
        self.http: HttpEndpoints | None = None
        self.ready = False  # L1 reserved and every socket bound (/readyz)
        self._loop_tick_s = time.monotonic()  # the event loop's last tick (/healthz)
        self.fd_inbox = FdInbox()  # sealed memfds passed by CPU engines (kvdepot.server.fdinbox)

    def _peer_attached(self, identity: bytes) -> None:
        self.liveness.peer_attached(identity)

    def _peer_detached(self, identity: bytes) -> None:
        self.liveness.peer_detached(identity)

    # ------------------------------------------------------------------ main loop

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        """Bind, serve until `stop`, then close everything."""
        for ep in self.config.endpoints:
            path = ipc_path(ep)
            if path and os.path.exists(path) and _endpoint_answers(ep):
                raise OSError(errno.EADDRINUSE,
                              f"another kvdepot daemon is serving at {ep}; stop it or pass another --endpoint")
        # a plain (blocking-API) socket driven by the loop through its edge-triggered FD: no
        # zmq.asyncio futures per message (they cost more than the rest of a small request)
        tcp_eps = [ep for ep in self.config.endpoints if ep.startswith("tcp://")]
        local_eps = [ep for ep in self.config.endpoints if not ep.startswith("tcp://")]
        check_endpoints(tcp_eps, self.config.curve)  # before anything is bound
        await self.tiers.open()
        ctx = zmq.Context()
        # ipc:// endpoints on one ROUTER, tcp:// ones on another (CURVE applies to a whole socket)
        sock = make_socket(ctx, zmq.ROUTER, local_eps, bind=True) if local_eps else None
        try:
            tcp = TcpFront(ctx, tcp_eps, self.config.curve) if tcp_eps else None
        except BaseException:
            if sock is not None:
                sock.close(0)
            ctx.term()
            raise
        self.front.bind(asyncio.get_running_loop(), sock, tcp)
        tiers = self.tiers
        self.events.open(ctx, [events_endpoint(ep) for ep in local_eps if ipc_path(ep)], asyncio.get_running_loop(),
                         lambda key: tiers.index.get(key) is not None or (tiers.l2 is not None
                                                                          and tiers.l2.get(key) is not None))
        for ep in self.config.endpoints:
            path = stream_path(ep)
            if path is not None:
                try:
                    await self.front.streams.listen(path)
                except OSError as exc:  # e.g. a path too long for AF_UNIX once suffixed: ZMQ still serves
                    log.warning("no stream socket at %s (%s); clients use ZMQ at %s", path, exc, ep)
                try:
                    self.fd_inbox.listen(fds_path(ipc_path(ep)))
                except OSError as exc:
                    log.warning("no descriptor socket beside %s (%s): CPU engines must use named shared memory",
                                ep, exc)
        if self.config.metrics_port:
            self.http = HttpEndpoints(self.metrics.registry, self._healthy, self._ready)
            self.http.serve(self.config.metrics_port, self.config.metrics_addr)
        pin = self.config.pin_l1
        if pin is None:
            pin = torch.cuda.is_available()
        if pin:
            self.pool.start_pinning()
        else:
            self.pool.start_prefault()
        sweeper = asyncio.create_task(self._sweep_loop())
        ticker = asyncio.create_task(self._tick_loop())
        log.info("kvdepot %s serving on %s (boot %s, L1 %d bytes, transfer engine %s)", kvdepot.__version__,
                 ", ".join(self.config.endpoints), self.boot_id, self.pool.capacity_bytes, CpuTransferEngine.name)
        freeze_heap()  # what exists now lives as long as the daemon: no full collection walks it again
        self._gc_pauses.install()  # serving from here on (the freeze's own collection is not counted)
        self.ready = True
        if on_ready:
            on_ready()
        try:
            await self._stop.wait()
        finally:
            self._gc_pauses.close()
            self.ready = False
            self.front.unbind()
            self.fd_inbox.close()
            await self.tiers.drain_to_l2(self.config.shutdown_drain_s)
            sweeper.cancel()
            ticker.cancel()
            await asyncio.gather(sweeper, ticker, return_exceptions=True)
            if self.http is not None:
                self.http.close()
            self.transfers.close()
            self.front.close()
            self.events.close()
            ctx.term()
            self._executor.shutdown(wait=True)
            self.tiers.close()
            self.pool.stop_prefault()
            if self._cuda is not None:
                self._cuda.close()
            for ep in self.config.endpoints:
                path = ipc_path(ep)
                if path and os.path.exists(path):
                    os.unlink(path)
            for reg in list(self.registrations.values()):
                reg.release_memory()
            trace.dump()
            log.info("kvdepot stopped")

    def stop(self) -> None:
        self._stop.set()

    # ------------------------------------------------------------------ helpers

    def _registration(self, reg_id: str) -> Registration:
        reg = self.registrations.get(reg_id)
        if reg is None:
            raise RequestError(
                ErrorCode.UNKNOWN_REGISTRATION,
                f"registration {reg_id!r} is not known to daemon boot {self.boot_id}; register again",
            )
        return reg

    # ------------------------------------------------------------------ handlers

    def _on_hello(self, identity: bytes, req: m.Hello) -> m.Msg:
        if req.protocol_version != m.PROTOCOL_VERSION:
            raise RequestError(ErrorCode.VERSION_MISMATCH,
                               f"client speaks protocol {req.protocol_version}, daemon {m.PROTOCOL_VERSION}; "
                               "upgrade the older side")
        pid = self.liveness.watch_pid(identity, req.pid)
        if pid:
            self.lookups.client_pids[identity] = pid
        return m.HelloReply(rid=req.rid, protocol_version=m.PROTOCOL_VERSION, boot_id=self.boot_id,
                            version=kvdepot.__version__)

    def _on_ping(self, identity: bytes, req: m.Ping) -> m.Msg:
        return m.Pong(rid=req.rid, boot_id=self.boot_id)

    def _cuda_runtime(self):
        if self._cuda is None:
            from kvdepot.gpu.cuda_path import CudaRuntime

            self._cuda = CudaRuntime(asyncio.get_running_loop(), self.config.staging_batch_bytes,
                                     self.config.copy_piece_bytes)
            self.transfer_engine_name = f"cpu-torch + {'cuda-kernels' if self._cuda.kernels else 'cuda-torch'}"
        return self._cuda

    def _register_cuda(self, req: m.Register, layout: EngineLayout) -> Registration:
        if any(s.kind != "cuda_ipc" for s in req.storages):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "a CUDA registration's storages must all be cuda_ipc")
        rt = self._cuda_runtime()
        dev, opened = rt.open_storages(req.storages)
        staging = fence = None
        fence_fds = self.fd_inbox.take(req.fence) if req.fence else None
        try:
            if req.staging is not None:
                staging = rt.open_staging(dev, req.staging)
            if staging is not None and fence_fds and req.fence_words:
                fence = rt.open_fence(fence_fds.pop(0), req.fence_words)
            engine = rt.open_engine(dev, layout, opened)
        except BaseException:
            rt.close_storages(opened + ([staging] if staging else []))
            if fence is not None:
                fence.close()
            raise
        finally:
            for fd in fence_fds or ():
                os.close(fd)
        if req.fence and fence is None and staging is not None:
            log.warning("%s: the engine's fence words were not passed (or expired); its staged stores wait for "
                        "their gathers on the engine's side", req.model)
        reg = Registration("", req.model, req.shard, req.pid, req.device, layout, None, engine, cuda_device=dev,
                           cuda_storages=opened + ([staging] if staging else []), fence=fence,
                           on_release=lambda storages: rt.release(engine, storages))
        if staging is not None:
            reg.staging_ptr, reg.staging_bytes = staging.ptr, staging.size_bytes
        return reg

    def _on_register(self, identity: bytes, req: m.Register) -> m.Msg:
        layout = group_layers(req.layers, req.groups, req.chunk_size, [s.size_bytes for s in req.storages])
        if req.device != "cpu":
            reg = self._register_cuda(req, layout)
            return self._add_registration(identity, req, reg)
        if any(s.kind not in ("shm", "memfd") for s in req.storages):
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "a CPU registration's storages must be shm or memfd")
        storages, files = [], []
        try:
            for s in req.storages:
                if s.kind == "memfd":  # sealed: can never shrink under a copy (kvdepot.gpu.shm)
                    fds = self.fd_inbox.take(s.name)
                    if not fds:
                        raise RequestError(ErrorCode.ENGINE_MEMORY, f"no descriptor was passed under token "
                                                                    f"{s.name!r} (or it expired)")
                    for extra in fds[1:]:
                        os.close(extra)
                    files.append((fds[0], s.size_bytes))
                    storages.append(open_memfd(fds[0], s.size_bytes))
                else:
                    if not self.config.allow_shm_names:
                        raise RequestError(ErrorCode.FORBIDDEN, f"named shared-memory segment {s.name!r} refused: an "
                                           "engine could shrink it under a copy and kill the daemon (SIGBUS); pass a "
                                           "sealed memfd (ShmKVCache's default), or start the daemon with "
                                           "--allow-shm-names to accept the risk")
                    storages.append(open_shm(s.name, s.size_bytes))
                    files.append((os.open(shm_path(s.name), os.O_RDONLY | os.O_CLOEXEC), s.size_bytes))
            engine = CpuTransferEngine(layout, storages)
        except BaseException:
            for fd, _ in files:
                os.close(fd)
            raise
        reg = Registration("", req.model, req.shard, req.pid, req.device, layout, storages, engine, files=files)
        return self._add_registration(identity, req, reg)

    def _add_registration(self, identity: bytes, req: m.Register, reg: Registration) -> m.Msg:
        layout = reg.layout
        reg.identity, reg.watch_pid = identity, self.liveness.watch_pid(identity, req.pid)
        self._reg_seq += 1
        reg_id = reg.id = f"{self.boot_id[:8]}-{self._reg_seq}"
        self.registrations[reg_id] = reg
        if req.model not in self._models:
            self._models.add(req.model)
            self.metrics.add_model(req.model)
        self.metrics.registered_engines.set(len(self.registrations))
        log.info("registered %s: model %s shard %s pid %d, %d layer groups, %d bytes per chunk", reg_id,
                 req.model, req.shard, req.pid, len(layout.groups), layout.object_bytes)
        return m.RegisterReply(rid=req.rid, registration=reg_id, layout_fingerprint=layout.fingerprint,
                               object_bytes=layout.object_bytes, boot_id=self.boot_id,
                               staging=bool(reg.staging_bytes), fence=reg.fence is not None, chains=True,
                               landed=bool(reg.fence is not None and reg.fence.dev_ptr))

    def _unregister(self, reg: Registration) -> None:
        self.registrations.pop(reg.id, None)
        reg.closed = True
        if reg.fence is not None and reg.active:  # stores still waiting for its gathers never get them
            self._cuda.path(reg.cuda_device).cancel(reg.fence)
        if reg.active == 0:
            reg.release_memory()
        self.metrics.registered_engines.set(len(self.registrations))
        log.info("unregistered %s", reg.id)

    def _on_unregister(self, identity: bytes, req: m.Unregister) -> m.Msg:
        self._unregister(self._registration(req.registration))
        return m.OkReply(rid=req.rid)

    def _model_label(self, model: str) -> str:
        """Metric label for a model name from a request: registered models only (a small set
        the operator controls), anything else is "other"."""
        return model if model in self._models else "other"

    def _on_describe(self, identity: bytes, req: m.Describe) -> m.Msg:
        engines = [
            m.EngineInfo(
                registration=r.id, model=r.model, shard=r.shard, pid=r.pid, device=r.device,
                chunk_size=r.layout.chunk_size, object_bytes=r.layout.object_bytes,
                layout_fingerprint=r.layout.fingerprint, groups=[g.info() for g in r.layout.groups],
                stored_chunks=r.stored_chunks, retrieved_chunks=r.retrieved_chunks, staging_bytes=r.staging_bytes)
            for r in self.registrations.values()
        ]
        info = m.DaemonInfo(
            boot_id=self.boot_id, version=kvdepot.__version__, protocol_version=m.PROTOCOL_VERSION,
            endpoints=list(self.config.endpoints), metrics_port=self.config.metrics_port,
            uptime_s=time.monotonic() - self.started,
            tiers=self.tiers.infos(),
            engines=engines, lookup_requested_tokens=self.lookups.requested_tokens,
            lookup_hit_tokens=self.lookups.hit_tokens, stored_chunks=self.transfers.stored_chunks,
            retrieved_chunks=self.transfers.retrieved_chunks, evicted_chunks=self.index.evictions,
            injected_faults=dict(self._faults.counts) if self._faults else {},
            stuck_transfers=self.watchdog.stuck_infos(), tenants=self.tiers.tenant_infos(),
            transfer_engine=self.transfer_engine_name, pinned_requests=len(self.lookups.pins))
        return m.DescribeReply(rid=req.rid, info=info)

    # ------------------------------------------------------------------ liveness

    async def _tick_loop(self) -> None:
        while True:
            self._loop_tick_s = time.monotonic()
            await asyncio.sleep(_TICK_S)

    def _healthy(self) -> tuple[bool, str]:
        """/healthz (any thread): the event loop ticked within `_STALL_S`."""
        age_s = time.monotonic() - self._loop_tick_s
        if age_s > _STALL_S:
            return False, f"event loop stalled: no tick for {age_s:.1f} s"
        return True, "ok"

    def _ready(self) -> tuple[bool, str]:
        """/readyz (any thread): serving (L1 reserved at construction, every socket bound)."""
        if self.ready:
            return True, "ready"
        return False, "stopping" if self._stop.is_set() else "starting: sockets not bound yet"

    def sweep(self) -> None:
        """Reclaim what dead engines held (`PeerLiveness.sweep`), declare copies past their
        deadline stuck (`CopyWatchdog.check_stuck`), write L1's least recently used entries
        ahead to L2 if stores left it short (`Tiers.spill_ahead`)."""
        self.liveness.sweep()
        self.watchdog.check_stuck(time.monotonic())
        self.tiers.spill_ahead()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.liveness_interval_s)
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - never let the sweeper die
                log.exception("sweep failed")


def _endpoint_answers(endpoint: str, timeout_s: float = 0.5) -> bool:
    """True if a daemon answers a ping at ``endpoint`` within ``timeout_s``."""
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.DEALER, endpoint, bind=False)
    try:
        sock.send(codec.encode(m.Ping(rid=1)))
        return bool(sock.poll(int(timeout_s * 1000)))
    finally:
        sock.close(0)


def run_daemon(config: DaemonConfig) -> None:
    """Run the daemon on uvloop until SIGINT/SIGTERM."""
    import signal

    import uvloop

    async def main() -> None:
        d = Daemon(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, d.stop)
        await d.serve(on_ready=lambda: print(f"kvdepot ready on {', '.join(config.endpoints)} boot {d.boot_id}",
                                             flush=True))

    uvloop.run(main())
