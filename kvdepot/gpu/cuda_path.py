"""The daemon's CUDA data path: open engines' memory by IPC handle, and move chunks between
engine blocks and pinned L1 objects through device staging, without blocking the event loop.

Per device and direction there is a *lane* (``KvdLane`` in ``csrc/kvdepot_kernels.cu``): a
kernel stream, a DMA stream, two device staging slots and a completion watcher thread. STORE, per batch of
chunks::

    kernel stream: wait(engine's interprocess event) -> wait(slot free) -> gather launches
    DMA stream:    wait(gathered) -> D2H staging -> each L1 object -> mark slot free

RETRIEVE is the mirror on its own lane (H2D, then scatter), and the daemon records one of the
registration's interprocess events after the scatter; the engine waits on it before reading
its blocks, so the reply goes out as soon as the work is enqueued. With two slots per lane,
gathering batch i+1 overlaps the PCIe copy of batch i, and the two directions overlap.

A whole request is enqueued by ONE call into the kernel library (`kvd_store` /
`kvd_retrieve`): event waits, every launch (block ids travel in the kernel parameters), the
copies, slot recycling and the completion watch. So the event loop's cost per request is a
ctypes call, whatever the number of layers, groups or chunks. Completion: the lane's watcher
thread (in the library, outside the GIL) polls the request's last event (spinning 20 us, then
every 5 us) and writes an 8-byte token into a pipe the event loop watches; the event loop never
waits on the GPU.
"""

from __future__ import annotations

import array
import asyncio
import ctypes
import logging
import os
import struct
from collections.abc import Callable, Sequence

import torch

from kvdepot import trace
from kvdepot.gpu.kernels import KernelError, Kernels, KvdGroupDesc, load_kernels
from kvdepot.gpu.layout import EngineLayout
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.messages import StorageSpec

log = logging.getLogger("kvdepot.cuda")

DEFAULT_BATCH_BYTES = 64 << 20  # staging bytes per slot (2 slots per direction per GPU)
# a chunk object larger than this moves in pieces inside the library (see kvd_engine_set_piece_bytes);
# the environment variable exists for tests, which use small pieces to exercise the piece path
PIECE_BYTES = int(os.environ.get("KVDEPOT_PIECE_BYTES", str(8 << 20)))
_MAX_OPEN_EVENTS = 1024  # engines' interprocess events kept open per GPU
_GPU_ERROR_BIT = 1 << 63  # set in a completion token when the GPU reported an error
# interprocess events a registration's retrieves record in turn: a reply's event is re-recorded
# only this many retrieves later, so an engine that waits on it soon waits for its own copies,
# not for the copies of the retrieves queued behind it
RETRIEVE_EVENTS = 32


def device_index_by_uuid(uuid: str) -> int:
    """CUDA ordinal (in this process's visible devices) of the GPU with this UUID.

    Raises:
        RequestError(ENGINE_MEMORY): no visible GPU has that UUID (the daemon must see the
            engine's GPU; check CUDA_VISIBLE_DEVICES of both).
    """
    want = uuid.removeprefix("GPU-")
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid).removeprefix("GPU-") == want:
            return i
    raise RequestError(ErrorCode.ENGINE_MEMORY,
                       f"no GPU with UUID {uuid} is visible to the daemon (check CUDA_VISIBLE_DEVICES)")


class CompletionPipe:
    """8-byte completion tokens written into a pipe by the kernel library's lane watchers; the
    event loop runs their callbacks. A token with bit 63 set reports a GPU error: its callback
    gets a `KernelError`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.read_fd, self.write_fd = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self.read_fd, False)
        self._callbacks: dict[int, Callable[[BaseException | None], None]] = {}
        self._next = 1
        self._partial = b""
        self.loop = loop
        loop.add_reader(self.read_fd, self._drain)

    def expect(self, callback: Callable[[BaseException | None], None]) -> int:
        token = self._next
        self._next += 1
        self._callbacks[token] = callback
        return token

    def forget(self, token: int) -> None:
        self._callbacks.pop(token, None)

    def replace(self, token: int, callback: Callable[[BaseException | None], None]) -> None:
        """Run ``callback`` instead when ``token`` arrives."""
        self._callbacks[token] = callback

    def _drain(self) -> None:
        try:
            data = self._partial + os.read(self.read_fd, 1 << 16)
        except BlockingIOError:
            return
        n = len(data) // 8 * 8
        self._partial = data[n:]
        for (token,) in struct.iter_unpack("<Q", data[:n]):
            err = None
            if token & _GPU_ERROR_BIT:
                token &= ~_GPU_ERROR_BIT
                err = KernelError("a CUDA error occurred while the transfer ran on the GPU")
            cb = self._callbacks.pop(token, None)
            if cb is not None:
                try:
                    cb(err)
                except Exception:  # noqa: BLE001 - one bad callback must not stop completions
                    log.exception("completion callback failed")

    def close(self) -> None:
        self.loop.remove_reader(self.read_fd)
        os.close(self.read_fd)
        os.close(self.write_fd)


class CudaOpenedStorage:
    """One engine allocation opened by IPC handle: ``ptr`` = ``base_ptr`` + the storage's
    offset in the allocation."""

    def __init__(self, base_ptr: int, ptr: int, device: int, size_bytes: int = 0) -> None:
        self.base_ptr = base_ptr
        self.ptr = ptr
        self.device = device
        self.size_bytes = size_bytes


class NativeEngine:
    """One CUDA registration's layer groups inside the kernel library (``kvd_engine_create``).

    Args:
        kernels: the loaded library.
        device: CUDA ordinal of the engine's GPU.
        layout: the registration's `EngineLayout`.
        storage_ptrs: device pointer of each storage (index = `LayerSpec.storage`), as opened.
    """

    def __init__(self, kernels: Kernels, device: int, layout: EngineLayout, storage_ptrs: Sequence[int]) -> None:
        self.kernels = kernels
        self.device = device
        self.layout = layout
        descs = [KvdGroupDesc.from_group(g, layout.object_bytes, layout.chunk_size) for g in layout.groups]
        layer_ptrs = [[storage_ptrs[s] + off for s, off in g.offsets] for g in layout.groups]
        try:
            self.handle = kernels.engine_create(device, descs, layer_ptrs, layout.chunk_size, layout.object_bytes)
        except KernelError as exc:
            raise RequestError(ErrorCode.LAYOUT, f"the kernels cannot use this layout: {exc}") from None
        self.pieces = kernels.engine_set_piece_bytes(self.handle, PIECE_BYTES)
        # block ids go to the library flat, one list per layer group in layout order (several
        # layer groups may share a KV-cache group's ids)
        self._gids = [g.gid for g in layout.groups]
        # interprocess event recorded after each store's gathers (early store replies carry it)
        self.gathered_event: int = 0
        self.gathered_event_handle: bytes = b""
        # and after each store's copies into L1 (the bytes are in place)
        self.stored_event: int = 0
        self.stored_event_handle: bytes = b""

    def flat_ids(self, block_ids: Sequence[Sequence[int]]) -> array.array:
        """int32 block ids, ``block_ids[gid]`` for each layer group in order (see `kvd_store`)."""
        gids = self._gids
        if len(gids) == 1:
            return array.array("i", block_ids[gids[0]])
        out = array.array("i")
        for gid in gids:
            out.extend(block_ids[gid])
        return out

    def close(self) -> None:
        if self.handle:
            self.kernels.engine_destroy(self.handle)
            self.handle = 0


class CudaDevicePath:
    """The two lanes (store, retrieve) of one GPU and the engines' events opened on it."""

    SLOTS = 2

    def __init__(self, device: int, kernels: Kernels, completions: CompletionPipe,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.device = device
        self.kernels = kernels
        self.completions = completions
        self.store_lane = kernels.lane_create(device, batch_bytes, self.SLOTS)
        try:
            self.retrieve_lane = kernels.lane_create(device, batch_bytes, self.SLOTS)
        except BaseException:
            kernels.lane_destroy(self.store_lane)
            raise
        self._engine_events: dict[bytes, int] = {}
        self._notified = ctypes.c_int(0)
        self._notified_ptr = ctypes.addressof(self._notified)
        lib = kernels.lib
        self._kvd_store, self._kvd_retrieve, self._kvd_dma = lib.kvd_store, lib.kvd_retrieve, lib.kvd_dma

    def reserve(self, object_bytes: int) -> None:
        """Make both lanes' slots hold at least one ``object_bytes`` object (at registration)."""
        for lane in (self.store_lane, self.retrieve_lane):
            if self.kernels.lane_slot_bytes(lane) < object_bytes:
                self.kernels.lane_reserve(lane, object_bytes)

    def close(self) -> None:
        for lane in (self.store_lane, self.retrieve_lane):
            self.kernels.lane_destroy(lane)  # waits for the lane's pending work first
        for ev in self._engine_events.values():
            self.kernels.event_destroy(ev)
        self._engine_events.clear()

    def _engine_event(self, handle: bytes) -> int:
        ev = self._engine_events.get(handle)
        if ev is None:
            try:
                ev = self.kernels.event_open_ipc(handle, self.device)
            except KernelError as exc:
                raise RequestError(ErrorCode.ENGINE_MEMORY, f"cannot open the engine's CUDA event: {exc}") from None
            if len(self._engine_events) >= _MAX_OPEN_EVENTS:
                # destroying an event leaves the GPU waits already enqueued on it intact; the
                # store lane's deferred staged copies poll it from the CPU, so it goes only
                # once none of those waits on it
                for old in self._engine_events.values():
                    self.kernels.lane_retire_event(self.store_lane, old)
                self._engine_events.clear()
            self._engine_events[handle] = ev
        return ev

    def _after_call(self, rc: int, what: str, lane: int, token: int,
                    done: Callable[[BaseException | None], None]) -> None:
        """An enqueue returned ``rc`` != 0: report it through ``done`` once nothing of the
        request can still be running on the GPU."""
        err = KernelError(f"{what}: {self.kernels.error_text(rc)}")
        if self._notified.value:  # the note is queued behind whatever was enqueued
            self.completions.replace(token, lambda _e: done(err))
            return
        self.completions.forget(token)
        try:
            self.kernels.lane_synchronize(lane)  # rare: a failure before the note could be queued
        except KernelError as exc:
            log.error("CUDA lane unusable after %s: %s", what, exc)
        self.completions.loop.call_soon(done, err)

    def store(self, engine: NativeEngine, block_ids: Sequence[Sequence[int]], total_chunks: int,
              chunks: Sequence[int], host_ptrs: Sequence[int], engine_event: bytes,
              done: Callable[[BaseException | None], None], gathered_event: int | None = None,
              stored_event: int | None = None) -> None:
        """Enqueue the gather of the request's chunks ``chunks`` (indices < ``total_chunks``)
        into the pinned host objects at ``host_ptrs`` (object_bytes each, not crossing a
        registration); ``done(err)`` runs on the loop when the copies completed.
        ``gathered_event`` (interprocess, or None) is recorded after the last read of the
        engine's blocks, ``stored_event`` (or None) after the last copy into L1.

        Raises (nothing enqueued):
            RequestError(ENGINE_MEMORY): the engine's event cannot be opened.
        """
        ev = self._engine_event(engine_event) if engine_event else None
        ids = engine.flat_ids(block_ids)
        ch = array.array("i", chunks)
        hp = array.array("Q", host_ptrs)
        token = self.completions.expect(done)
        trace.point(-3, "pre_call")
        rc = self._kvd_store(self.store_lane, engine.handle, ev, ids.buffer_info()[0], total_chunks,
                             ch.buffer_info()[0], len(ch), hp.buffer_info()[0], gathered_event, stored_event,
                             self.completions.write_fd, token, self._notified_ptr)
        trace.point(-3, "post_call")
        if rc:
            self._after_call(rc, "kvd_store", self.store_lane, token, done)

    def retrieve(self, engine: NativeEngine, block_ids: Sequence[Sequence[int]], total_chunks: int,
                 host_ptrs: Sequence[int], skip_tokens: int, out_event: int | None,
                 done: Callable[[BaseException | None], None]) -> None:
        """Enqueue H2D + scatter of the host objects at ``host_ptrs`` (the request's leading
        chunks, chunk j = object j) into the engine's blocks, then record ``out_event``
        (interprocess, or None) after the scatter. Blocks of the first ``skip_tokens`` tokens are not
        touched; ``done(err)`` runs on the loop when the GPU finished reading the objects."""
        ids = engine.flat_ids(block_ids)
        hp = array.array("Q", host_ptrs)
        token = self.completions.expect(done)
        trace.point(-3, "pre_call")
        rc = self._kvd_retrieve(self.retrieve_lane, engine.handle, ids.buffer_info()[0], total_chunks, len(hp),
                                hp.buffer_info()[0], skip_tokens, out_event, self.completions.write_fd, token,
                                self._notified_ptr)
        trace.point(-3, "post_call")
        if rc:
            self._after_call(rc, "kvd_retrieve", self.retrieve_lane, token, done)


    def copy_staged(self, to_host: bool, srcs: Sequence[int], dsts: Sequence[int], object_bytes: int,
                    engine_event: bytes, out_event: int | None,
                    done: Callable[[BaseException | None], None]) -> None:
        """Enqueue ``len(srcs)`` PCIe copies of one object each between an engine's staging
        buffer (IPC-opened device memory) and pinned L1 objects: device -> host on the store
        lane (``to_host``), host -> device on the retrieve lane. No kernel runs in the daemon's
        CUDA context: the engine gathers / scatters in its own. The copies follow
        ``engine_event`` (interprocess handle, or b""): if it has not completed yet the lane's
        issuer thread polls it from the CPU and enqueues the copies then (the DMA stream never
        waits on another process's event). ``out_event`` (or None) is recorded after the
        copies when they are enqueued, so with an ``engine_event`` its handle must not be handed
        out before ``done``. ``done(err)`` runs on the loop when they completed.

        Raises (nothing enqueued):
            RequestError(ENGINE_MEMORY): the engine's event cannot be opened.
        """
        ev = self._engine_event(engine_event) if engine_event else None
        sp = array.array("Q", srcs)
        dp = array.array("Q", dsts)
        lane = self.store_lane if to_host else self.retrieve_lane
        token = self.completions.expect(done)
        rc = self._kvd_dma(lane, ev, sp.buffer_info()[0], dp.buffer_info()[0], object_bytes, len(sp), int(to_host),
                           out_event, self.completions.write_fd, token, self._notified_ptr)
        if rc:
            self._after_call(rc, "kvd_dma", lane, token, done)


class CudaRuntime:
    """All CUDA state of the daemon: device paths (created on first use) and IPC opening.

    Without the kernel library (none found and none could be built), transfers run on
    `kvdepot.gpu.torch_path` instead: correct, slower, and logged once as a warning.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        if not torch.cuda.is_available():
            raise RequestError(ErrorCode.UNSUPPORTED, "CUDA engine registered but the daemon sees no GPU")
        self.loop = loop
        self.batch_bytes = batch_bytes
        self.kernels = load_kernels()
        self.completions = CompletionPipe(loop)
        self.paths: dict[int, object] = {}  # CudaDevicePath, or TorchDevicePath without the library
        if self.kernels is None:
            from kvdepot.gpu.torch_path import CudartIpc

            log.warning("the CUDA transfer kernels are unavailable: CUDA engines are served by the torch fallback "
                        "(correct, several times slower); install nvcc and run `kvdepot build-kernels`")
            try:
                self._ipc = CudartIpc()
            except OSError as exc:
                raise RequestError(ErrorCode.UNSUPPORTED, f"cannot serve CUDA engines: {exc}") from None
        else:
            self._ipc = self.kernels

    def path(self, device: int):
        p = self.paths.get(device)
        if p is None:
            if self.kernels is None:
                from kvdepot.gpu.torch_path import TorchDevicePath

                p = TorchDevicePath(device, self.loop)
            else:
                try:
                    p = CudaDevicePath(device, self.kernels, self.completions, self.batch_bytes)
                except KernelError as exc:
                    raise RequestError(ErrorCode.ENGINE_MEMORY, f"cannot set up GPU {device}: {exc}") from None
            self.paths[device] = p
        return p

    def open_storages(self, storages: Sequence[StorageSpec]) -> tuple[int, list[CudaOpenedStorage]]:
        """Open every storage's IPC handle on the GPU with its UUID. All storages of one
        registration must be on one GPU.

        Raises:
            RequestError(ENGINE_MEMORY): unknown GPU, mixed GPUs, a handle that cannot be opened.
        """
        devices = {device_index_by_uuid(s.device_uuid) for s in storages}
        if len(devices) != 1:
            raise RequestError(ErrorCode.ENGINE_MEMORY, "a registration's storages must all be on one GPU")
        dev = devices.pop()
        opened: list[CudaOpenedStorage] = []
        try:
            for s in storages:
                try:
                    base = self._ipc.ipc_open(s.handle, dev)
                except KernelError as exc:
                    raise RequestError(ErrorCode.ENGINE_MEMORY, f"cannot open CUDA IPC handle: {exc}") from None
                opened.append(CudaOpenedStorage(base, base + s.handle_offset_bytes, dev, s.size_bytes))
        except BaseException:
            self.close_storages(opened)
            raise
        return dev, opened

    def open_staging(self, device: int, spec: StorageSpec) -> CudaOpenedStorage | None:
        """Open an engine's staging buffer (`Register.staging`) on ``device``; None when this
        daemon cannot serve staged transfers (no kernel library: its torch fallback gathers
        and scatters itself).

        Raises:
            RequestError(ENGINE_MEMORY): not a cuda_ipc spec on the registration's GPU, or the
                handle cannot be opened.
        """
        if self.kernels is None:
            return None
        if spec.kind != "cuda_ipc" or device_index_by_uuid(spec.device_uuid) != device:
            raise RequestError(ErrorCode.ENGINE_MEMORY, "the staging buffer must be cuda_ipc memory on the GPU "
                                                        "of the registration's KV caches")
        try:
            base = self.kernels.ipc_open(spec.handle, device)
        except KernelError as exc:
            raise RequestError(ErrorCode.ENGINE_MEMORY, f"cannot open the staging buffer's IPC handle: {exc}") from None
        return CudaOpenedStorage(base, base + spec.handle_offset_bytes, device, spec.size_bytes)

    def open_engine(self, device: int, layout: EngineLayout, opened: Sequence[CudaOpenedStorage]
                    ) -> tuple[object, list[tuple[object, bytes]]]:
        """The registration's engine (a `NativeEngine` in the library, with the lanes' staging
        grown to hold one of its objects; a torch `CudaTransferEngine` without the library) and
        the `RETRIEVE_EVENTS` interprocess events its retrieves record in turn:
        (engine, [(event, event handle bytes)]).

        Raises:
            RequestError(LAYOUT / ENGINE_MEMORY): the library refuses the layout, or CUDA fails.
        """
        path = self.path(device)
        if self.kernels is None:
            from kvdepot.gpu.cuda_engine import CudaTransferEngine

            dev = torch.device("cuda", device)
            engine = CudaTransferEngine(layout, [o.ptr for o in opened], [o.size_bytes for o in opened], dev,
                                        use_kernels=False)
            with torch.cuda.device(dev):
                events = [torch.cuda.Event(interprocess=True) for _ in range(RETRIEVE_EVENTS)]
                engine.gathered_event = torch.cuda.Event(interprocess=True)
                engine.stored_event = torch.cuda.Event(interprocess=True)
            engine.gathered_event_handle = bytes(engine.gathered_event.ipc_handle())
            engine.stored_event_handle = bytes(engine.stored_event.ipc_handle())
            return engine, [(ev, bytes(ev.ipc_handle())) for ev in events]
        engine = NativeEngine(self.kernels, device, layout, [o.ptr for o in opened])
        events: list[tuple[int, bytes]] = []
        try:
            path.reserve(layout.object_bytes)
            for _ in range(RETRIEVE_EVENTS):
                events.append(self.kernels.event_create_ipc(device))
            engine.gathered_event, engine.gathered_event_handle = self.kernels.event_create_ipc(device)
            engine.stored_event, engine.stored_event_handle = self.kernels.event_create_ipc(device)
        except BaseException as exc:
            self._destroy_events(engine, events)
            engine.close()
            if isinstance(exc, KernelError):
                raise RequestError(ErrorCode.ENGINE_MEMORY, f"CUDA set-up of the registration failed: {exc}") from None
            raise
        return engine, events

    def _destroy_events(self, engine: NativeEngine, events: Sequence[tuple[int, bytes]]) -> None:
        for ev in [engine.gathered_event, engine.stored_event] + [e for e, _ in events]:
            if ev:
                try:
                    self.kernels.event_destroy(ev)
                except KernelError as exc:
                    log.warning("destroying an event failed: %s", exc)
        engine.gathered_event = engine.stored_event = 0

    def release(self, engine: NativeEngine, events: Sequence[tuple[object, bytes]],
                opened: Sequence[CudaOpenedStorage]) -> None:
        """Free a registration's CUDA state (no transfer of it may still be running)."""
        if self.kernels is not None:
            self._destroy_events(engine, events)
            engine.close()
        self.close_storages(opened)

    def close_storages(self, opened: Sequence[CudaOpenedStorage]) -> None:
        for o in opened:
            try:
                self._ipc.ipc_close(o.base_ptr, o.device)
            except (KernelError, RequestError) as exc:
                log.warning("closing an IPC mapping failed: %s", exc)

    def close(self) -> None:
        for p in self.paths.values():
            p.close()
        self.completions.close()
