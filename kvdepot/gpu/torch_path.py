"""The daemon's CUDA data path without the kernel library: torch streams, torch copies and
`copy_blocks_torch`, correct and slower. Used when the library can neither be found nor built
(no nvcc at install or on the daemon's machine); the daemon says so once.

Same interface as `kvdepot.gpu.cuda_path.CudaDevicePath`. Differences: staging is allocated per
request from torch's caching allocator, completions are waited for by a thread
(``torch.cuda.Event.synchronize`` in the loop's default executor), and IPC handles are opened
through the CUDA runtime torch itself loaded (`CudartIpc`).
"""

from __future__ import annotations

import asyncio
import ctypes
import glob
import os
from collections.abc import Callable, Sequence

import torch

from kvdepot.gpu.cuda_engine import CudaTransferEngine
from kvdepot.protocol.errors import ErrorCode, RequestError

_IPC_HANDLE_BYTES = 64
_CUDA_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcMemHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * _IPC_HANDLE_BYTES)]


def _load_cudart() -> ctypes.CDLL:
    """The CUDA runtime library torch uses (already loaded by ``import torch`` for CUDA builds)."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    torch_dir = os.path.dirname(torch.__file__)
    site = os.path.dirname(torch_dir)
    names += sorted(glob.glob(os.path.join(site, "nvidia", "**", "libcudart.so*"), recursive=True))
    names += sorted(glob.glob(os.path.join(torch_dir, "lib", "libcudart*.so*")))
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no CUDA runtime library (libcudart) found next to torch")


class CudartIpc:
    """``cudaIpcOpenMemHandle`` / ``cudaIpcCloseMemHandle`` through ctypes on torch's CUDA runtime.

    Raises (constructor):
        OSError: libcudart cannot be found.
    """

    ipc_handle_bytes = _IPC_HANDLE_BYTES

    def __init__(self) -> None:
        lib = _load_cudart()
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcMemHandle, ctypes.c_uint]
        lib.cudaIpcCloseMemHandle.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lib = lib

    def _check(self, err: int, what: str) -> None:
        if err != 0:
            raise RequestError(ErrorCode.ENGINE_MEMORY, f"{what}: {self.lib.cudaGetErrorString(err).decode()}")

    def ipc_open(self, handle: bytes, device: int) -> int:
        """Map another process's allocation on ``device``; returns its base device pointer.

        Raises:
            RequestError(ENGINE_MEMORY): wrong handle size or the CUDA error.
        """
        if len(handle) != _IPC_HANDLE_BYTES:
            raise RequestError(ErrorCode.ENGINE_MEMORY, f"IPC handle of {len(handle)} bytes, expected 64")
        out = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(out), _IpcMemHandle.from_buffer_copy(handle),
                                                      _CUDA_IPC_LAZY_ENABLE_PEER_ACCESS), "cudaIpcOpenMemHandle")
        return int(out.value)

    def ipc_close(self, ptr: int, device: int) -> None:
        with torch.cuda.device(device):
            self._check(self.lib.cudaIpcCloseMemHandle(ptr), "cudaIpcCloseMemHandle")


def host_tensor(ptr: int, size_bytes: int) -> torch.Tensor:
    """uint8 CPU tensor over ``size_bytes`` of host memory at ``ptr`` (not owned)."""
    return torch.frombuffer((ctypes.c_uint8 * size_bytes).from_address(ptr), dtype=torch.uint8)


class TorchDevicePath:
    """Store and retrieve lanes of one GPU in torch (see the module docstring)."""

    def __init__(self, device: int, loop: asyncio.AbstractEventLoop) -> None:
        self.device = torch.device("cuda", device)
        self.loop = loop
        with torch.cuda.device(self.device):
            self.store_stream = torch.cuda.Stream()
            self.retrieve_stream = torch.cuda.Stream()

    def reserve(self, object_bytes: int) -> None:
        pass  # staging comes from the caching allocator per request

    def close(self) -> None:
        self.store_stream.synchronize()
        self.retrieve_stream.synchronize()

    def _complete(self, stream: torch.cuda.Stream, keep: object, done: Callable[[BaseException | None], None]) -> None:
        ev = torch.cuda.Event()
        ev.record(stream)

        def finished(fut: asyncio.Future) -> None:
            del keep_alive[:]  # staging may be reused once the GPU is past it
            done(fut.exception())

        keep_alive = [keep]
        self.loop.run_in_executor(None, ev.synchronize).add_done_callback(finished)

    @staticmethod
    def _ids(engine: CudaTransferEngine, block_ids: Sequence[Sequence[int]], chunks: Sequence[int]
             ) -> list[list[int]]:
        lay = engine.layout
        out = []
        for gid, ids in enumerate(block_ids):
            n = lay.blocks_per_chunk(gid)
            out.append([b for j in chunks for b in ids[j * n:(j + 1) * n]])
        return out

    def store(self, engine: CudaTransferEngine, block_ids: Sequence[Sequence[int]], total_chunks: int,
              chunks: Sequence[int], host_ptrs: Sequence[int],
              done: Callable[[BaseException | None], None]) -> None:
        """As `CudaDevicePath.store`."""
        ob = engine.layout.object_bytes
        s = self.store_stream
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            staging = torch.empty(len(chunks) * ob, dtype=torch.uint8, device=self.device)
            engine.copy(staging, self._ids(engine, block_ids, chunks), len(chunks), True, s)
            for k, ptr in enumerate(host_ptrs):
                host_tensor(ptr, ob).copy_(staging[k * ob:(k + 1) * ob], non_blocking=True)
        self._complete(s, staging, done)

    def retrieve(self, engine: CudaTransferEngine, block_ids: Sequence[Sequence[int]], total_chunks: int,
                 host_ptrs: Sequence[int], skip_tokens: int, out_event: torch.cuda.Event | None,
                 done: Callable[[BaseException | None], None]) -> None:
        """As `CudaDevicePath.retrieve` (``out_event``: a torch interprocess event, or None)."""
        ob = engine.layout.object_bytes
        n = len(host_ptrs)
        s = self.retrieve_stream
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            staging = torch.empty(n * ob, dtype=torch.uint8, device=self.device)
            for k, ptr in enumerate(host_ptrs):
                staging[k * ob:(k + 1) * ob].copy_(host_tensor(ptr, ob), non_blocking=True)
            engine.copy(staging, self._ids(engine, block_ids, range(n)), n, False, s, skip_tokens=skip_tokens)
            if out_event is not None:
                out_event.record(s)
        self._complete(s, staging, done)
