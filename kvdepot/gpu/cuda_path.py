"""The daemon's CUDA data path: open engines' memory by IPC handle, and move chunks between
engine blocks and pinned L1 objects through device staging, without blocking the event loop.

Per device and direction there is a *lane*: a kernel stream, a DMA stream and two staging
slots. STORE, per batch of chunks::

    kernel stream: wait(engine's interprocess event) -> wait(slot free) -> gather kernel
    DMA stream:    wait(gathered) -> D2H staging -> each L1 object -> mark slot free

RETRIEVE is the mirror on its own lane (H2D, then scatter), and the daemon records the
registration's interprocess event after the scatter; the engine waits on it before reading
its blocks, so the reply goes out as soon as the work is enqueued. With two slots per lane,
gathering batch i+1 overlaps the PCIe copy of batch i, and the two directions overlap.

Everything on the hot path is a raw call into the kernel library (launch with the block ids
in the kernel parameters, batched ``cudaMemcpyAsync``), not torch stream contexts. Completion
is signalled by a host function the GPU runs after the job (``cudaLaunchHostFunc``) writing an
8-byte token into a pipe the event loop watches: no thread is blocked on the GPU, and the
loop never waits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
from collections.abc import Callable, Sequence

import torch

from kvdepot import trace
from kvdepot.gpu.cuda_engine import CudaTransferEngine
from kvdepot.gpu.kernels import KernelError, Kernels, load_kernels
from kvdepot.gpu.layout import EngineLayout
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.protocol.messages import StorageSpec

log = logging.getLogger("kvdepot.cuda")

DEFAULT_BATCH_BYTES = 64 << 20  # staging bytes per slot (2 slots per direction per GPU)


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
    """Tokens written by GPU host functions into a pipe; the event loop runs their callbacks."""

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

    def _drain(self) -> None:
        try:
            data = self._partial + os.read(self.read_fd, 1 << 16)
        except BlockingIOError:
            return
        n = len(data) // 8 * 8
        self._partial = data[n:]
        for (token,) in struct.iter_unpack("<Q", data[:n]):
            cb = self._callbacks.pop(token, None)
            if cb is not None:
                try:
                    cb(None)
                except Exception:  # noqa: BLE001 - one bad callback must not stop completions
                    log.exception("completion callback failed")

    def close(self) -> None:
        self.loop.remove_reader(self.read_fd)
        os.close(self.read_fd)
        os.close(self.write_fd)


class CudaOpenedStorage:
    """One engine allocation opened by IPC handle: ``ptr`` = ``base_ptr`` + the storage's
    offset in the allocation."""

    def __init__(self, base_ptr: int, ptr: int, device: int) -> None:
        self.base_ptr = base_ptr
        self.ptr = ptr
        self.device = device


class _Lane:
    """One direction's streams and double-buffered staging on one GPU."""

    SLOTS = 2

    def __init__(self, device: torch.device, slot_bytes: int) -> None:
        self.device = device
        with torch.cuda.device(device):
            self.kernel_stream = torch.cuda.Stream()
            self.dma_stream = torch.cuda.Stream()
            # completion host functions run here, so a host function's latency never stalls
            # the DMA or kernel stream that the next request's copies are queued on
            self.notify_stream = torch.cuda.Stream()
        self._notify_after = torch.cuda.Event()
        self.slot_bytes = slot_bytes
        self.staging = [torch.empty(slot_bytes, dtype=torch.uint8, device=device) for _ in range(self.SLOTS)]
        # events are created once and re-recorded: a wait captures the record current at the
        # time it is enqueued, so re-recording never affects waits already enqueued
        self.slot_free = [torch.cuda.Event() for _ in range(self.SLOTS)]
        self._slot_used = [False] * self.SLOTS
        self._handoff = torch.cuda.Event()
        self._next = 0

    def take(self, nbytes: int, producer: torch.cuda.Stream) -> tuple[int, torch.Tensor]:
        """Next slot (at least ``nbytes``), with ``producer`` made to wait until it is free."""
        i = self._next
        self._next = (i + 1) % self.SLOTS
        if nbytes > self.staging[i].numel():
            old = self.staging[i]
            old.record_stream(self.kernel_stream)  # freed only after pending work on it
            old.record_stream(self.dma_stream)
            self.staging[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self._slot_used[i]:
            producer.wait_event(self.slot_free[i])
        return i, self.staging[i]

    def handoff(self, producer: torch.cuda.Stream, consumer: torch.cuda.Stream) -> None:
        """Make ``consumer`` wait for the work enqueued on ``producer`` so far."""
        self._handoff.record(producer)
        consumer.wait_event(self._handoff)

    def release(self, i: int, consumer: torch.cuda.Stream) -> None:
        self.slot_free[i].record(consumer)
        self._slot_used[i] = True


class CudaDevicePath:
    """Lanes and transfer enqueueing for one GPU."""

    def __init__(self, device: int, kernels: Kernels, completions: CompletionPipe,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        self.device = torch.device("cuda", device)
        self.kernels = kernels
        self.completions = completions
        self.batch_bytes = batch_bytes
        self.store_lane = _Lane(self.device, batch_bytes)
        self.retrieve_lane = _Lane(self.device, batch_bytes)
        self._engine_events: dict[bytes, torch.cuda.Event] = {}

    def close(self) -> None:
        pass

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

    def _finish(self, lane: _Lane, stream: torch.cuda.Stream, done: Callable[[BaseException | None], None]) -> None:
        token = self.completions.expect(done)
        try:
            lane._notify_after.record(stream)
            lane.notify_stream.wait_event(lane._notify_after)
            self.kernels.notify(lane.notify_stream.cuda_stream, self.completions.write_fd, token)
        except BaseException:
            self.completions.forget(token)
            raise

    def store(self, engine: CudaTransferEngine, block_ids: Sequence[Sequence[int]], chunks: Sequence[int],
              host_objects: Sequence[torch.Tensor], engine_event: bytes, done: Callable[[BaseException | None], None]
              ) -> None:
        """Enqueue the gather of chunk indices ``chunks`` into ``host_objects`` (pinned uint8
        tensors of object_bytes each); ``done(err)`` runs on the loop when the copies completed."""
        lay = engine.layout
        ob = lay.object_bytes
        lane = self.store_lane
        ks, ds = lane.kernel_stream, lane.dma_stream
        if engine_event:
            ks.wait_event(self._engine_event(engine_event))
        trace.point(-2, "s_event")
        k = 0
        for batch in self._batches(chunks, ob):
            slot, st = lane.take(len(batch) * ob, ks)
            trace.point(-2, "s_take")
            engine.copy(st, self._ids_for(lay, block_ids, batch), len(batch), True, ks)
            trace.point(-2, "s_kernel")
            lane.handoff(ks, ds)
            base = st.data_ptr()
            self.kernels.memcpy_batch([host_objects[k + i].data_ptr() for i in range(len(batch))],
                                      [base + i * ob for i in range(len(batch))], [ob] * len(batch), ds.cuda_stream)
            trace.point(-2, "s_memcpy")
            k += len(batch)
            lane.release(slot, ds)
        self._finish(lane, ds, done)
        trace.point(-2, "s_notify")

    def retrieve(self, engine: CudaTransferEngine, block_ids: Sequence[Sequence[int]], host_objects: Sequence[torch.Tensor],
                 skip_tokens: int, out_event: torch.cuda.Event, done: Callable[[BaseException | None], None]) -> None:
        """Enqueue H2D + scatter of ``host_objects`` (chunk j = object j) into the engine's
        blocks, then record ``out_event`` (interprocess) on the scatter stream. Chunks wholly
        inside ``skip_tokens`` are not copied at all."""
        lay = engine.layout
        ob, cs_tokens = lay.object_bytes, lay.chunk_size
        first = min(skip_tokens // cs_tokens, len(host_objects))
        chunks = list(range(first, len(host_objects)))
        lane = self.retrieve_lane
        ks, ds = lane.kernel_stream, lane.dma_stream
        for batch in self._batches(chunks, ob):
            slot, st = lane.take(len(batch) * ob, ds)
            base = st.data_ptr()
            self.kernels.memcpy_batch([base + i * ob for i in range(len(batch))],
                                      [host_objects[j].data_ptr() for j in batch], [ob] * len(batch), ds.cuda_stream)
            lane.handoff(ds, ks)
            skip = max(skip_tokens - batch[0] * cs_tokens, 0)
            engine.copy(st, self._ids_for(lay, block_ids, batch), len(batch), False, ks, skip_tokens=skip)
            lane.release(slot, ks)
        out_event.record(ks)
        self._finish(lane, ks, done)


class CudaRuntime:
    """All CUDA state of the daemon: device paths (created on first use) and IPC opening."""

    def __init__(self, loop: asyncio.AbstractEventLoop, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        if not torch.cuda.is_available():
            raise RequestError(ErrorCode.UNSUPPORTED, "CUDA engine registered but the daemon sees no GPU")
        self.loop = loop
        self.batch_bytes = batch_bytes
        self.kernels = load_kernels()
        if self.kernels is None:
            raise RequestError(ErrorCode.UNSUPPORTED,
                               "CUDA engines need the kvdepot kernel library (install nvcc or set KVDEPOT_KERNELS_SO)")
        self.completions = CompletionPipe(loop)
        self.paths: dict[int, CudaDevicePath] = {}

    def path(self, device: int) -> CudaDevicePath:
        p = self.paths.get(device)
        if p is None:
            p = self.paths[device] = CudaDevicePath(device, self.kernels, self.completions, self.batch_bytes)
        return p

    def open_storages(self, storages: Sequence[StorageSpec]) -> tuple[int, list[CudaOpenedStorage]]:
        """Open every storage's IPC handle on the GPU with its UUID. All storages of one
        registration must be on one GPU.

        Raises:
            RequestError(ENGINE_MEMORY / UNSUPPORTED): unknown GPU, mixed GPUs, a handle that
                cannot be opened, or no kernel library to open handles with.
        """
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
        self.completions.close()
