"""The daemon's CUDA data path: open engines' memory by IPC handle, and move chunks between
engine blocks and pinned L1 objects through device staging, without blocking the event loop.

Per device there are two streams per direction. STORE::

    gather stream: wait(engine's interprocess event) -> gather kernel (batch -> staging) -> record ready
    copy stream:   wait(ready) -> D2H staging -> each L1 object -> record done

RETRIEVE is the mirror (H2D on the copy stream, scatter on the gather stream), and the daemon
records the registration's interprocess event after the scatter; the engine waits on it
before reading its blocks, so the reply goes out as soon as the work is enqueued.

Staging buffers come from torch's caching allocator per batch and are handed to the other
stream with ``record_stream``, so consecutive batches and requests pipeline (gathering batch
i+1 overlaps the PCIe copy of batch i) with no CPU-side waits. Completion is observed by one
thread per device that synchronizes on each job's done event in FIFO order and hands the
callback back to the event loop (``call_soon_threadsafe``): the loop never blocks on the GPU.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence

import torch

from kvdepot.gpu.cuda_engine import CudaTransferEngine
from kvdepot.gpu.kernels import KernelError, load_kernels
from kvdepot.gpu.layout import EngineLayout
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.messages import StorageSpec

log = logging.getLogger("kvdepot.cuda")

DEFAULT_BATCH_BYTES = 128 << 20  # staging bytes per batch (one kernel launch + one DMA per object)


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


class _Completer(threading.Thread):
    """Waits on CUDA events in FIFO order and runs callbacks on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, device: torch.device) -> None:
        super().__init__(name=f"kvdepot-cuda-done-{device.index}", daemon=True)
        self.loop = loop
        self.device = device
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def run(self) -> None:
        torch.cuda.set_device(self.device)
        while True:
            job = self.jobs.get()
            if job is None:
                return
            event, callback = job
            err = None
            try:
                event.synchronize()  # releases the GIL
            except Exception as exc:  # noqa: BLE001 - reported to the waiting request
                err = exc
            self.loop.call_soon_threadsafe(callback, err)


class CudaOpenedStorage:
    """One engine allocation opened by IPC handle."""

    def __init__(self, base_ptr: int, ptr: int, device: int) -> None:
        self.base_ptr = base_ptr
        self.ptr = ptr
        self.device = device


class CudaDevicePath:
    """Streams, completion thread and transfer enqueueing for one GPU."""

    def __init__(self, device: int, loop: asyncio.AbstractEventLoop, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.device = torch.device("cuda", device)
        self.batch_bytes = batch_bytes
        with torch.cuda.device(self.device):
            # one (kernel, DMA) stream pair per direction, so STOREs and RETRIEVEs overlap on
            # the two PCIe directions instead of queueing behind each other
            self.store_kernel_stream = torch.cuda.Stream()
            self.store_copy_stream = torch.cuda.Stream()
            self.retrieve_copy_stream = torch.cuda.Stream()
            self.retrieve_kernel_stream = torch.cuda.Stream()
        self.completer = _Completer(loop, self.device)
        self.completer.start()
        self._engine_events: dict[bytes, torch.cuda.Event] = {}

    def close(self) -> None:
        self.completer.jobs.put(None)

    def _engine_event(self, handle: bytes) -> torch.cuda.Event:
        ev = self._engine_events.get(handle)
        if ev is None:
            try:
                ev = torch.cuda.Event.from_ipc_handle(self.device, handle)
            except Exception as exc:  # noqa: BLE001
                raise RequestError(ErrorCode.ENGINE_MEMORY, f"cannot open the engine's CUDA event: {exc}") from None
            if len(self._engine_events) > 4096:
                self._engine_events.clear()
            self._engine_events[handle] = ev
        return ev

    def _batches(self, chunk_indices: Sequence[int], object_bytes: int) -> list[list[int]]:
        per = max(1, self.batch_bytes // object_bytes)
        return [list(chunk_indices[i:i + per]) for i in range(0, len(chunk_indices), per)]

    @staticmethod
    def _ids_for(layout: EngineLayout, block_ids: Sequence[Sequence[int]], chunks: Sequence[int]) -> list[list[int]]:
        out = []
        for gid, ids in enumerate(block_ids):
            n = layout.blocks_per_chunk(gid)
            out.append([b for j in chunks for b in ids[j * n:(j + 1) * n]])
        return out

    def store(self, engine: CudaTransferEngine, block_ids: Sequence[Sequence[int]], chunks: Sequence[int],
              host_objects: Sequence[torch.Tensor], engine_event: bytes, done: Callable[[BaseException | None], None]
              ) -> None:
        """Enqueue the gather of chunk indices ``chunks`` into ``host_objects`` (pinned uint8
        tensors of object_bytes each); ``done(err)`` runs on the loop when the copies completed."""
        lay = engine.layout
        ob = lay.object_bytes
        ks, cs = self.store_kernel_stream, self.store_copy_stream
        with torch.cuda.device(self.device):
            if engine_event:
                ks.wait_event(self._engine_event(engine_event))
            k = 0
            for batch in self._batches(chunks, ob):
                with torch.cuda.stream(ks):
                    staging = torch.empty(len(batch) * ob, dtype=torch.uint8, device=self.device)
                engine.copy(staging, self._ids_for(lay, block_ids, batch), len(batch), True, ks)
                cs.wait_stream(ks)
                with torch.cuda.stream(cs):
                    for i in range(len(batch)):
                        host_objects[k].copy_(staging[i * ob:(i + 1) * ob], non_blocking=True)
                        k += 1
                staging.record_stream(cs)
            finished = torch.cuda.Event()
            finished.record(cs)
        self.completer.jobs.put((finished, done))

    def retrieve(self, engine: CudaTransferEngine, block_ids: Sequence[Sequence[int]], host_objects: Sequence[torch.Tensor],
                 skip_tokens: int, out_event: torch.cuda.Event, done: Callable[[BaseException | None], None]) -> None:
        """Enqueue H2D + scatter of ``host_objects`` (chunk j = object j) into the engine's
        blocks, then record ``out_event`` (interprocess) on the scatter stream. Chunks wholly
        inside ``skip_tokens`` are not copied at all."""
        lay = engine.layout
        ob, cs_tokens = lay.object_bytes, lay.chunk_size
        first = min(skip_tokens // cs_tokens, len(host_objects))
        chunks = list(range(first, len(host_objects)))
        ks, cs = self.retrieve_kernel_stream, self.retrieve_copy_stream
        with torch.cuda.device(self.device):
            for batch in self._batches(chunks, ob):
                with torch.cuda.stream(cs):
                    staging = torch.empty(len(batch) * ob, dtype=torch.uint8, device=self.device)
                    for i, j in enumerate(batch):
                        staging[i * ob:(i + 1) * ob].copy_(host_objects[j], non_blocking=True)
                ks.wait_stream(cs)
                skip = max(skip_tokens - batch[0] * cs_tokens, 0)
                engine.copy(staging, self._ids_for(lay, block_ids, batch), len(batch), False, ks, skip_tokens=skip)
                staging.record_stream(ks)
            out_event.record(ks)
            finished = torch.cuda.Event()
            finished.record(ks)
        self.completer.jobs.put((finished, done))


class CudaRuntime:
    """All CUDA state of the daemon: device paths (created on first use) and IPC opening."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        if not torch.cuda.is_available():
            raise RequestError(ErrorCode.UNSUPPORTED, "CUDA engine registered but the daemon sees no GPU")
        self.loop = loop
        self.batch_bytes = batch_bytes
        self.kernels = load_kernels()
        self.paths: dict[int, CudaDevicePath] = {}

    def path(self, device: int) -> CudaDevicePath:
        p = self.paths.get(device)
        if p is None:
            p = self.paths[device] = CudaDevicePath(device, self.loop, self.batch_bytes)
        return p

    def open_storages(self, storages: Sequence[StorageSpec]) -> tuple[int, list[CudaOpenedStorage]]:
        """Open every storage's IPC handle on the GPU with its UUID. All storages of one
        registration must be on one GPU.

        Raises:
            RequestError(ENGINE_MEMORY / UNSUPPORTED): unknown GPU, mixed GPUs, a handle that
                cannot be opened, or no kernel library to open handles with.
        """
        if self.kernels is None:
            raise RequestError(ErrorCode.UNSUPPORTED,
                               "CUDA IPC needs the kvdepot kernel library (install nvcc or set KVDEPOT_KERNELS_SO)")
        devices = {device_index_by_uuid(s.device_uuid) for s in storages}
        if len(devices) != 1:
            raise RequestError(ErrorCode.ENGINE_MEMORY, "a registration's storages must all be on one GPU")
        dev = devices.pop()
        opened: list[CudaOpenedStorage] = []
        try:
            for s in storages:
                try:
                    base = self.kernels.ipc_open(s.handle, dev)
                except KernelError as exc:
                    raise RequestError(ErrorCode.ENGINE_MEMORY, f"cannot open CUDA IPC handle: {exc}") from None
                opened.append(CudaOpenedStorage(base, base + s.handle_offset_bytes, dev))
        except BaseException:
            self.close_storages(opened)
            raise
        return dev, opened

    def close_storages(self, opened: Sequence[CudaOpenedStorage]) -> None:
        for o in opened:
            try:
                self.kernels.ipc_close(o.base_ptr, o.device)
            except KernelError as exc:
                log.warning("closing an IPC mapping failed: %s", exc)

    def close(self) -> None:
        for p in self.paths.values():
            p.close()
