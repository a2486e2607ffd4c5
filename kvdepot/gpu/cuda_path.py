"""The daemon's CUDA data path: open engines' memory by IPC handle, and move chunks between
engine blocks and pinned L1 objects through device staging, without blocking the event loop.

Per device and direction there is a *lane* (``KvdLane`` in ``csrc/kvd_lanes.cuh``): a
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
from kvdepot.gpu.kernels import DMA_CALL_HEAD, KernelError, Kernels, KvdGroupDesc, load_kernels
from kvdepot.gpu.layout import EngineLayout
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.messages import StorageSpec

log = logging.getLogger("kvdepot.cuda")

DEFAULT_BATCH_BYTES = 64 << 20  # staging bytes per slot (2 slots per direction per GPU)
DEFAULT_PIECE_BYTES = 8 << 20  # a chunk object larger than this moves in pieces (kvd_engine_set_piece_bytes)
_GPU_ERROR_BIT = 1 << 63  # set in a completion token when the GPU reported an error
_NOT_COPIED_BIT = 1 << 62  # set when a deferred copy was cancelled or timed out before it began


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
            elif token & _NOT_COPIED_BIT:
                token &= ~_NOT_COPIED_BIT
                err = RequestError(ErrorCode.ENGINE_MEMORY, "the engine's fence word was not written (its gather did "
                                                            "not run within 30 s, the engine gave it up, or it "
                                                            "unregistered): nothing copied")
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


class FenceWords:
    """An engine's fence words mapped in the daemon: ``words`` uint64 words of a sealed memfd
    the engine passed (`Register.fence`), which its GPU writes after each staged store's
    gather (`kvd_engine_gather` / `kvd_engine_signal`); word ``value % words`` must hold ``value`` before the
    daemon copies the store's ring region (`Store.fence`).

    With ``kernels`` whose driver has the stream memory operations (`Kernels.stream_memops`),
    the words are also mapped for this process's GPU (``dev_ptr``, else 0): a gated retrieve's
    DMA stream writes its landed word (`Retrieve.landed`).

    Raises:
        RequestError(ENGINE_MEMORY): the descriptor is not a memfd sealed against shrinking,
            or is smaller than ``words`` words.
    """

    def __init__(self, fd: int, words: int, kernels: Kernels | None = None) -> None:
        from kvdepot.gpu.shm import open_memfd

        self.words = words
        self.buffer = open_memfd(fd, words * 8)  # uint8 tensor; the mapping lives as long as it
        self.ptr = self.buffer.data_ptr()
        os.close(fd)
        self.dev_ptr = 0
        self._kernels = None
        if kernels is not None and kernels.stream_memops():
            try:
                self.dev_ptr = kernels.host_register_mapped(self.ptr, words * 8)
                self._kernels = kernels
            except KernelError as exc:
                log.warning("fence words not mapped for this GPU (%s): retrieves' scatters are not gated", exc)

    def landed_ptr(self, seq: int) -> int:
        """Device address (this process's GPU) of staging region ``seq``'s word."""
        return self.dev_ptr + (seq % self.words) * 8

    def word_ptr(self, value: int) -> int:
        """Host address of the word that must hold ``value``."""
        return self.ptr + (value % self.words) * 8

    def close(self) -> None:
        if self._kernels is not None:
            try:
                self._kernels.host_unregister(self.ptr)
            except KernelError as exc:
                log.warning("unregistering an engine's fence words failed: %s", exc)
            self._kernels = None
        self.buffer = None


class NativeEngine:
    """One CUDA registration's layer groups inside the kernel library (``kvd_engine_create``).

    Args:
        kernels: the loaded library.
        device: CUDA ordinal of the engine's GPU.
        layout: the registration's `EngineLayout`.
        storage_ptrs: device pointer of each storage (index = `LayerSpec.storage`), as opened.
        piece_bytes: a chunk object larger than this moves in ceil(object_bytes / piece_bytes)
            pieces (token ranges of whole blocks, at most the library's KVD_MAX_PIECES = 64); 0 = whole.
    """

    def __init__(self, kernels: Kernels, device: int, layout: EngineLayout, storage_ptrs: Sequence[int],
                 piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        self.kernels = kernels
        self.device = device
        self.layout = layout
        descs = [KvdGroupDesc.from_group(g, layout.object_bytes, layout.chunk_size) for g in layout.groups]
        layer_ptrs = [[storage_ptrs[s] + off for s, off in g.offsets] for g in layout.groups]
        try:
            self.handle = kernels.engine_create(device, descs, layer_ptrs, layout.chunk_size, layout.object_bytes)
        except KernelError as exc:
            raise RequestError(ErrorCode.LAYOUT, f"the kernels cannot use this layout: {exc}") from None
        self.pieces = kernels.engine_set_piece_bytes(self.handle, piece_bytes)
        # block ids go to the library flat, one list per layer group in layout order (several
        # layer groups may share a KV-cache group's ids)
        self._gids = [g.gid for g in layout.groups]

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
    """The two lanes (store, retrieve) of one GPU."""

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
        self._notified = ctypes.c_int(0)
        self._notified_ptr = ctypes.addressof(self._notified)
        lib = kernels.lib
        self._kvd_store, self._kvd_retrieve, self._kvd_dma_call = lib.kvd_store, lib.kvd_retrieve, lib.kvd_dma_call
        # copy_staged's argument block (the kernel library's KvdDmaCall): filled per request
        # with one pack_into and passed as one pointer (the loop thread is its only user);
        # grown when a request has more copies than any before
        self._dma_block = ctypes.create_string_buffer(DMA_CALL_HEAD.size + 16 * 64)
        self._dma_block_ptr = ctypes.addressof(self._dma_block)
        self._dma_formats: dict[int, struct.Struct] = {}  # copies -> the block's format

    def reserve(self, object_bytes: int) -> None:
        """Make both lanes' slots hold at least one ``object_bytes`` object (at registration)."""
        for lane in (self.store_lane, self.retrieve_lane):
            if self.kernels.lane_slot_bytes(lane) < object_bytes:
                self.kernels.lane_reserve(lane, object_bytes)

    def close(self) -> None:
        for lane in (self.store_lane, self.retrieve_lane):
            self.kernels.lane_destroy(lane)  # waits for the lane's pending work first

    def cancel(self, fence: FenceWords) -> int:
        """Fail the staged stores still waiting for a word of ``fence`` (the engine is gone):
        their ``done`` gets RequestError(ENGINE_MEMORY), nothing copied. Returns how many."""
        return self.kernels.lane_cancel(self.store_lane, fence.ptr, fence.ptr + fence.words * 8)

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
              chunks: Sequence[int], host_ptrs: Sequence[int],
              done: Callable[[BaseException | None], None]) -> None:
        """Enqueue the gather of the request's chunks ``chunks`` (indices < ``total_chunks``)
        into the pinned host objects at ``host_ptrs`` (object_bytes each, not crossing a
        registration); ``done(err)`` runs on the loop when the copies completed. The engine's
        writes of the blocks must have completed (the client waits for them before sending)."""
        ids = engine.flat_ids(block_ids)
        ch = array.array("i", chunks)
        hp = array.array("Q", host_ptrs)
        token = self.completions.expect(done)
        trace.point(-3, "pre_call")
        rc = self._kvd_store(self.store_lane, engine.handle, ids.buffer_info()[0], total_chunks,
                             ch.buffer_info()[0], len(ch), hp.buffer_info()[0],
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
                    fence: tuple[int, int] | None, done: Callable[[BaseException | None], None],
                    landed: tuple[int, int] | None = None) -> None:
        """Enqueue ``len(srcs)`` PCIe copies of one object each between an engine's staging
        buffer (IPC-opened device memory) and pinned L1 objects: device -> host on the store
        lane (``to_host``), host -> device on the retrieve lane. No kernel runs in the daemon's
        CUDA context: the engine gathers / scatters in its own. ``fence`` (word address, value)
        or None: the copies follow the engine's write of the value into that word (after its
        gather); until then the lane's issuer thread polls the word from the CPU (the DMA
        stream never waits on another process). ``done(err)`` runs on the loop when the copies
        completed (RequestError(ENGINE_MEMORY) if the word never came: nothing copied).
        ``landed`` (word's device address here, value) or None: after the copies the DMA
        stream writes the value into that word (`Retrieve.landed`: the engine's scatter waits
        for it on its own stream); completion means it was written."""
        n = len(srcs)
        if len(dsts) != n:
            raise ValueError(f"{n} sources but {len(dsts)} destinations")
        fmt = self._dma_formats.get(n)
        if fmt is None:
            fmt = self._dma_formats[n] = struct.Struct(f"{DMA_CALL_HEAD.format}{2 * n}Q")
            if fmt.size > len(self._dma_block):
                self._dma_block = ctypes.create_string_buffer(fmt.size)
                self._dma_block_ptr = ctypes.addressof(self._dma_block)
        lane = self.store_lane if to_host else self.retrieve_lane
        word, value = fence if fence is not None else (0, 0)
        landed_word, landed_value = landed if landed is not None else (0, 0)
        token = self.completions.expect(done)
        fmt.pack_into(self._dma_block, 0, lane, word, value, object_bytes, n, int(to_host),
                      self.completions.write_fd, token, self._notified_ptr, landed_word, landed_value, *srcs, *dsts)
        rc = self._kvd_dma_call(self._dma_block_ptr)
        if rc:
            self._after_call(rc, "kvd_dma", lane, token, done)


class CudaRuntime:
    """All CUDA state of the daemon: device paths (created on first use) and IPC opening.

    Without the kernel library (none found and none could be built), transfers run on
    `kvdepot.gpu.torch_path` instead: correct, slower, and logged once as a warning.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, batch_bytes: int = DEFAULT_BATCH_BYTES,
                 piece_bytes: int = DEFAULT_PIECE_BYTES) -> None:
        if not torch.cuda.is_available():
            raise RequestError(ErrorCode.UNSUPPORTED, "CUDA engine registered but the daemon sees no GPU")
        self.loop = loop
        self.batch_bytes = batch_bytes
        self.piece_bytes = piece_bytes  # see NativeEngine
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

    def open_engine(self, device: int, layout: EngineLayout, opened: Sequence[CudaOpenedStorage]) -> object:
        """The registration's engine: a `NativeEngine` in the library, with the lanes' staging
        grown to hold one of its objects; a torch `CudaTransferEngine` without the library.

        Raises:
            RequestError(LAYOUT / ENGINE_MEMORY): the library refuses the layout, or CUDA fails.
        """
        path = self.path(device)
        if self.kernels is None:
            from kvdepot.gpu.cuda_engine import CudaTransferEngine

            return CudaTransferEngine(layout, [o.ptr for o in opened], [o.size_bytes for o in opened],
                                      torch.device("cuda", device), use_kernels=False)
        engine = NativeEngine(self.kernels, device, layout, [o.ptr for o in opened], self.piece_bytes)
        try:
            path.reserve(layout.object_bytes)
        except BaseException as exc:
            engine.close()
            if isinstance(exc, KernelError):
                raise RequestError(ErrorCode.ENGINE_MEMORY, f"CUDA set-up of the registration failed: {exc}") from None
            raise
        return engine

    def open_fence(self, fd: int, words: int) -> FenceWords | None:
        """Map an engine's fence words (`Register.fence`; takes ``fd``); None when this daemon
        serves no staged transfers (no kernel library). Raises as `FenceWords`."""
        if self.kernels is None:
            os.close(fd)
            return None
        return FenceWords(fd, words, self.kernels)

    def release(self, engine, opened: Sequence[CudaOpenedStorage]) -> None:
        """Free a registration's CUDA state (no transfer of it may still be running)."""
        if self.kernels is not None:
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
