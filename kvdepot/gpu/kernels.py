"""Typed wrapper of the CUDA transfer kernels (``csrc/kvdepot_kernels.cu`` and the parts it
includes) and their torch reference.

The kernels live in a shared library that links only the CUDA runtime and is called through
ctypes with raw device pointers and a ``cudaStream_t``. Where the library comes from, first
match wins:

1. ``$KVDEPOT_KERNELS_SO``: a prebuilt library (e.g. built on a machine with nvcc, carried over);
2. ``kvdepot/gpu/_lib/libkvdepot_kernels.so``, built at install when nvcc was present;
3. the per-user cache ``$XDG_CACHE_HOME/kvdepot/kernels/<source hash>-sm<arch>/``;
4. built on first use with nvcc into that cache, under a file lock (the cache is re-checked
   after taking the lock, so concurrent processes build once). ``KVDEPOT_NO_JIT=1`` forbids
   this step (production images should ship the library).

With no library and no nvcc, `load_kernels` returns None and callers use `copy_blocks_torch`,
which is correct but slower; the daemon says so once.
"""

from __future__ import annotations

import array
import ctypes
import fcntl
import logging
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

from kvdepot.config import user_cache_dir
from kvdepot.gpu import build as _build
from kvdepot.gpu.build import source_hash
from kvdepot.gpu.layout import LayerGroup

log = logging.getLogger("kvdepot.kernels")

ENV_SO = "KVDEPOT_KERNELS_SO"
ENV_NO_JIT = "KVDEPOT_NO_JIT"
# built at install (setup.py) for `build.INSTALL_ARCHS` when nvcc was there
PACKAGED_SO = Path(__file__).parent / "_lib" / "libkvdepot_kernels.so"
ABI_VERSION = 14

KVD_OK, KVD_EINVAL, KVD_EALIGN, KVD_ECUDA = 0, 1, 2, 3


class KvdGroupDesc(ctypes.Structure):
    """Mirror of ``struct KvdGroupDesc`` in the .cu file (all int64; byte units)."""

    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_layers", "block_size", "num_heads", "num_kv", "row_bytes", "block_stride", "token_stride",
        "head_stride", "kv_stride", "object_offset", "object_bytes", "blocks_per_chunk")]

    @classmethod
    def from_group(cls, g: LayerGroup, object_bytes: int, chunk_size: int) -> KvdGroupDesc:
        v = g.view
        return cls(g.num_layers, v.block_size, v.num_heads, v.num_kv, v.row_bytes, v.block_stride, v.token_stride,
                   v.head_stride, v.kv_stride, g.object_offset, object_bytes, chunk_size // v.block_size)


class KernelError(RuntimeError):
    """A kernel entry point returned an error code."""


# The header of kvd_dma_call's argument block (KvdDmaCall in kvdepot_kernels.cu): lane, fence
# word, its value, bytes per copy, copies n, to_host, completion fd, token, notified pointer,
# landed word (device address or 0), its value; 2n uint64 pointers follow (sources, then
# destinations).
DMA_CALL_HEAD = struct.Struct("=QQQQqqqQQQQ")


def set_copy_argtypes(lib) -> None:
    """The ctypes argument types of the daemon's copy-enqueue calls (``kvd_dma`` and its
    one-block form ``kvd_dma_call``) on ``lib``: the kernel library, or a stand-in with the
    same C signatures (``benchmarks/daemon_loop.py --copy-call``)."""
    vp = ctypes.c_void_p
    lib.kvd_dma.argtypes = [vp, vp, ctypes.c_uint64, vp, vp, ctypes.c_uint64, ctypes.c_int64, ctypes.c_int, vp,
                            ctypes.c_int, ctypes.c_uint64, vp, ctypes.c_uint64, ctypes.c_uint64]
    lib.kvd_dma_call.argtypes = [vp]


class Kernels:
    """The loaded library. Methods take device pointers as ints."""

    def __init__(self, path: str) -> None:
        self.path = path
        lib = ctypes.CDLL(path)
        lib.kvd_abi_version.restype = ctypes.c_int
        if lib.kvd_abi_version() != ABI_VERSION:
            raise KernelError(f"{path}: ABI {lib.kvd_abi_version()} != {ABI_VERSION}; rebuild the kernels")
        lib.kvd_source_hash.restype = ctypes.c_char_p
        built_from = lib.kvd_source_hash().decode()
        if built_from != source_hash():
            raise KernelError(f"{path} was built from other source ({built_from}, this kvdepot has {source_hash()}); "
                              "rebuild it with `kvdepot build-kernels`")
        lib.kvd_vec_bytes.restype = ctypes.c_int
        lib.kvd_vec_bytes.argtypes = [ctypes.POINTER(KvdGroupDesc), ctypes.POINTER(ctypes.c_uint64), ctypes.c_int64,
                                      ctypes.c_uint64]
        lib.kvd_copy_blocks.restype = ctypes.c_int
        lib.kvd_copy_blocks.argtypes = [
            ctypes.POINTER(KvdGroupDesc), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
            ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        lib.kvd_last_cuda_error.restype = ctypes.c_char_p
        lib.kvd_ipc_open_mem.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]
        lib.kvd_ipc_close_mem.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.kvd_host_register.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.kvd_host_unregister.argtypes = [ctypes.c_void_p]
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.kvd_lane_create.argtypes = [i32, ctypes.c_uint64, i32, ctypes.POINTER(vp)]
        lib.kvd_lane_reserve.argtypes = [vp, ctypes.c_uint64]
        lib.kvd_lane_slot_bytes.argtypes = [vp]
        lib.kvd_lane_slot_bytes.restype = ctypes.c_uint64
        lib.kvd_lane_synchronize.argtypes = [vp]
        lib.kvd_lane_destroy.argtypes = [vp]
        lib.kvd_lane_destroy.restype = None
        lib.kvd_engine_create.argtypes = [i32, ctypes.POINTER(KvdGroupDesc), i32, vp, i64, i64, ctypes.POINTER(vp)]
        lib.kvd_engine_destroy.argtypes = [vp]
        lib.kvd_engine_destroy.restype = None
        lib.kvd_engine_set_piece_bytes.argtypes = [vp, ctypes.c_uint64]
        lib.kvd_engine_pieces.argtypes = [vp]
        # hot path: pointers go in as plain ints
        lib.kvd_store.argtypes = [vp, vp, vp, i64, vp, i64, vp, i32, ctypes.c_uint64, vp]
        lib.kvd_retrieve.argtypes = [vp, vp, vp, i64, i64, vp, i64, vp, i32, ctypes.c_uint64, vp]
        lib.kvd_engine_gather.argtypes = [vp, vp, i64, vp, vp, ctypes.c_uint64, vp]
        lib.kvd_engine_gather_pieces.argtypes = [vp, vp, i64, i32, vp, vp, vp, vp, vp]
        lib.kvd_engine_scatter.argtypes = [vp, vp, i64, i64, vp, i64, vp, ctypes.c_uint64, vp]
        lib.kvd_engine_scatter_gated.argtypes = [vp, vp, i64, vp, i64, vp, vp, ctypes.c_uint64, vp]
        lib.kvd_stream_memops.argtypes = []
        set_copy_argtypes(lib)
        lib.kvd_engine_signal.argtypes = [vp, ctypes.c_uint64, vp]
        lib.kvd_engine_signal_by_kernel.argtypes = [vp, ctypes.c_uint64, vp]
        lib.kvd_host_register_mapped.argtypes = [vp, ctypes.c_size_t, ctypes.POINTER(vp)]
        lib.kvd_lane_cancel.argtypes = [vp, vp, vp]
        lib.kvd_event_create_ipc.argtypes = [i32, ctypes.POINTER(vp), ctypes.c_char_p]
        lib.kvd_event_open_ipc.argtypes = [ctypes.c_char_p, i32, ctypes.POINTER(vp)]
        lib.kvd_event_destroy.argtypes = [vp]
        self.ipc_handle_bytes = lib.kvd_ipc_handle_bytes()
        self.ipc_event_handle_bytes = lib.kvd_ipc_event_handle_bytes()
        self.lib = lib

    def _check(self, rc: int, what: str) -> None:
        if rc != KVD_OK:
            detail = self.lib.kvd_last_cuda_error().decode() if rc == KVD_ECUDA else f"code {rc}"
            raise KernelError(f"{what}: {detail}")

    def ipc_open(self, handle: bytes, device: int) -> int:
        """Map another process's allocation (``cudaIpcMemHandle_t`` bytes) on ``device``;
        returns the base device pointer.

        Raises:
            KernelError: wrong handle size, or the CUDA error (e.g. the owner exited).
        """
        if len(handle) != self.ipc_handle_bytes:
            raise KernelError(f"IPC handle of {len(handle)} bytes, expected {self.ipc_handle_bytes}")
        out = ctypes.c_void_p()
        self._check(self.lib.kvd_ipc_open_mem(handle, device, ctypes.byref(out)), "cudaIpcOpenMemHandle")
        return int(out.value)

    def ipc_close(self, ptr: int, device: int) -> None:
        self._check(self.lib.kvd_ipc_close_mem(ptr, device), "cudaIpcCloseMemHandle")

    def host_register(self, ptr: int, size_bytes: int) -> None:
        """Page-lock ``[ptr, ptr + size_bytes)`` of host memory for DMA (cudaHostRegister)."""
        self._check(self.lib.kvd_host_register(ptr, size_bytes), "cudaHostRegister")

    def host_unregister(self, ptr: int) -> None:
        self._check(self.lib.kvd_host_unregister(ptr), "cudaHostUnregister")

    def vec_bytes(self, desc: KvdGroupDesc, layer_ptrs: Sequence[int], staging_ptr: int) -> int:
        arr = (ctypes.c_uint64 * len(layer_ptrs))(*layer_ptrs)
        return self.lib.kvd_vec_bytes(ctypes.byref(desc), arr, len(layer_ptrs), staging_ptr)

    def copy_blocks(self, desc: KvdGroupDesc, layer_ptrs_dev: int, block_ids: Sequence[int], first_slot: int,
                    num_slots: int, staging_ptr: int, to_staging: bool, vec_bytes: int, device: int, stream: int,
                    threads_per_cta: int = 256) -> None:
        """Launch one gather (``to_staging``) or scatter on ``stream`` (asynchronous).

        ``block_ids``: host-side ids, one per slot from slot 0; they travel in the launch
        parameters (no device copy). ``device``: the ordinal ``stream`` belongs to.

        Raises:
            KernelError: invalid arguments, misalignment for ``vec_bytes``, or a launch error.
        """
        ids = array.array("i", block_ids)
        rc = self.lib.kvd_copy_blocks(ctypes.byref(desc), layer_ptrs_dev, ids.buffer_info()[0], first_slot, num_slots,
                                      staging_ptr, int(to_staging), vec_bytes, threads_per_cta, device, stream)
        if rc != KVD_OK:
            what = {KVD_EINVAL: "invalid arguments", KVD_EALIGN: f"misaligned for {vec_bytes}-byte words",
                    KVD_ECUDA: f"CUDA error: {self.lib.kvd_last_cuda_error().decode()}"}.get(rc, f"code {rc}")
            raise KernelError(f"kvd_copy_blocks: {what}")

    # ---------------------------------------------------------------- whole-request API (ABI 3)

    def lane_create(self, device: int, slot_bytes: int, slots: int = 2) -> int:
        """A lane (kernel, DMA and notify streams + ``slots`` device staging slots of
        ``slot_bytes``) on ``device``; returns its handle. Free with `lane_destroy`."""
        out = ctypes.c_void_p()
        self._check(self.lib.kvd_lane_create(device, slot_bytes, slots, ctypes.byref(out)), "kvd_lane_create")
        return int(out.value)

    def lane_reserve(self, lane: int, slot_bytes: int) -> None:
        """Grow the lane's slots to ``slot_bytes`` (waits for its pending work: not per request)."""
        self._check(self.lib.kvd_lane_reserve(lane, slot_bytes), "kvd_lane_reserve")

    def lane_slot_bytes(self, lane: int) -> int:
        return int(self.lib.kvd_lane_slot_bytes(lane))

    def lane_synchronize(self, lane: int) -> None:
        """Block until the lane's enqueued work completed (error recovery and shutdown only)."""
        self._check(self.lib.kvd_lane_synchronize(lane), "kvd_lane_synchronize")

    def lane_destroy(self, lane: int) -> None:
        self.lib.kvd_lane_destroy(lane)

    def engine_create(self, device: int, descs: Sequence[KvdGroupDesc], layer_ptrs: Sequence[Sequence[int]],
                      chunk_size: int, object_bytes: int) -> int:
        """A registration's groups for `kvd_store` / `kvd_retrieve`: ``descs[g]`` and the device
        pointer of each of its layers (``layer_ptrs[g]``). Returns the handle; free with
        `engine_destroy` once no transfer uses it.

        Raises:
            KernelError: inconsistent descriptors (code 1) or a CUDA error.
        """
        arr = (KvdGroupDesc * len(descs))(*descs)
        flat = array.array("Q", [p for ptrs in layer_ptrs for p in ptrs])
        out = ctypes.c_void_p()
        self._check(self.lib.kvd_engine_create(device, arr, len(descs), flat.buffer_info()[0], chunk_size,
                                               object_bytes, ctypes.byref(out)), "kvd_engine_create")
        return int(out.value)

    def engine_destroy(self, engine: int) -> None:
        self.lib.kvd_engine_destroy(engine)

    def engine_set_piece_bytes(self, engine: int, piece_bytes: int) -> int:
        """Move the engine's chunks in pieces of about ``piece_bytes`` (token ranges of whole
        blocks; 0 = whole chunks) so gather/scatter overlaps the PCIe copy inside a chunk;
        returns the number of pieces per chunk (at most 64). The default is 8 MiB."""
        self._check(self.lib.kvd_engine_set_piece_bytes(engine, piece_bytes), "kvd_engine_set_piece_bytes")
        return self.lib.kvd_engine_pieces(engine)

    def engine_gather(self, engine: int, flat_ids, total_chunks: int, dst_ptr: int, stream: int,
                      fence_word_ptr: int = 0, fence_value: int = 0) -> None:
        """Engine side: gather the request's ``total_chunks`` chunks (``flat_ids``: an int32
        ``array.array``, per layer group in order, as `kvd_store` takes them) into device memory
        at ``dst_ptr`` (256-byte aligned; chunk j at ``dst_ptr + j * object_bytes``, canonical
        object format) on ``stream`` (a ``cudaStream_t`` as int); then, if ``fence_word_ptr``
        is not 0, the GPU's write of ``fence_value`` into that fence word (`engine_signal`),
        in the same call. Layer groups share launches (up to 800 block slots and 4 groups per
        launch; more groups: one launch per group).

        Raises:
            KernelError: bad arguments, misaligned ``dst_ptr`` or word, or the CUDA launch error
                (a launch enqueued before the error may still run).
        """
        self._check(self.lib.kvd_engine_gather(engine, flat_ids.buffer_info()[0], total_chunks, dst_ptr,
                                               fence_word_ptr, fence_value, stream), "kvd_engine_gather")

    def engine_gather_pieces(self, engine: int, flat_ids, dst_ptrs, piece_chunks, fence_words, fence_values,
                             stream: int) -> None:
        """Engine side: `engine_gather` of the chunks of several requests in one call: piece q's
        ``piece_chunks[q]`` chunks (the next ones of ``flat_ids``, an int32 ``array.array`` per
        layer group in order, every piece's chunks) into ``dst_ptrs[q]`` (256-byte aligned),
        one launch per run of pieces whose regions lie end to end; then the GPU's write of
        ``fence_values[q]`` into fence word ``fence_words[q]`` (device addresses, 8-byte
        aligned) for every piece, after the whole gather. ``dst_ptrs``, ``fence_words``,
        ``fence_values``: ``array.array("Q")``; ``piece_chunks``: ``array.array("q")``; all of
        one length.

        Raises:
            KernelError: bad arguments (lengths, counts, a pointer 0 or misaligned: nothing
                enqueued), or the CUDA launch error (a launch enqueued before it may still run;
                no word is written).
        """
        n = len(piece_chunks)
        if not (len(dst_ptrs) == len(fence_words) == len(fence_values) == n):
            raise KernelError(f"kvd_engine_gather_pieces: {n} pieces, {len(dst_ptrs)} regions, "
                              f"{len(fence_words)} words, {len(fence_values)} values")
        self._check(self.lib.kvd_engine_gather_pieces(engine, flat_ids.buffer_info()[0], sum(piece_chunks), n,
                                                      dst_ptrs.buffer_info()[0], piece_chunks.buffer_info()[0],
                                                      fence_words.buffer_info()[0], fence_values.buffer_info()[0],
                                                      stream), "kvd_engine_gather_pieces")

    def engine_scatter(self, engine: int, flat_ids, total_chunks: int, nchunks: int, src_ptr: int,
                       skip_tokens: int, stream: int, done_word_ptr: int = 0, done_value: int = 0) -> None:
        """Engine side: scatter the request's leading ``nchunks`` chunk objects at ``src_ptr``
        into the engine's blocks on ``stream``, leaving the blocks of the first ``skip_tokens``
        tokens untouched; then, if ``done_word_ptr`` is not 0, the GPU's write of
        ``done_value`` into that word (a fence word, `engine_signal`), in the same call.
        Raises KernelError as `engine_gather`."""
        self._check(self.lib.kvd_engine_scatter(engine, flat_ids.buffer_info()[0], total_chunks, nchunks, src_ptr,
                                                skip_tokens, done_word_ptr or None, done_value, stream),
                    "kvd_engine_scatter")

    def engine_scatter_gated(self, engine: int, flat_ids, total_chunks: int, src_ptr: int, skip_tokens: int,
                             gate_word_ptr: int, stream: int, done_word_ptr: int = 0, done_value: int = 0) -> None:
        """Engine side: `engine_scatter` of all ``total_chunks`` chunks enqueued on ``stream``
        behind a wait until the landed word at ``gate_word_ptr`` (a fence word's device address)
        has ``LANDED_BIT`` set; each chunk is written only if its index is below the count the
        word then carries (`kvdepot.client.staging.landed_value`: the daemon's DMA stream writes
        it after its copies into the ring, `Retrieve.landed`). The stream waits until the word
        is written: whoever enqueued this writes it from the CPU if the daemon will not.

        Raises:
            KernelError: the driver lacks the stream wait (`stream_memops`), bad arguments, or
                the launch failed (the wait may be enqueued then: write the word).
        """
        self._check(self.lib.kvd_engine_scatter_gated(engine, flat_ids.buffer_info()[0], total_chunks, src_ptr,
                                                      skip_tokens, gate_word_ptr, done_word_ptr or None, done_value,
                                                      stream), "kvd_engine_scatter_gated")

    def stream_memops(self) -> bool:
        """Whether the driver has the stream memory operations of a gated scatter (the DMA
        stream's write of a landed word, an engine stream's wait for it)."""
        return bool(self.lib.kvd_stream_memops())

    def event_create_ipc(self, device: int) -> tuple[int, bytes]:
        """An interprocess event (timing disabled) on ``device``: (handle, cudaIpcEventHandle_t bytes)."""
        out = ctypes.c_void_p()
        buf = ctypes.create_string_buffer(self.ipc_event_handle_bytes)
        self._check(self.lib.kvd_event_create_ipc(device, ctypes.byref(out), buf), "cudaIpcGetEventHandle")
        return int(out.value), buf.raw

    def event_open_ipc(self, handle: bytes, device: int) -> int:
        """Open another process's interprocess event.

        Raises:
            KernelError: wrong handle size, or the CUDA error.
        """
        if len(handle) != self.ipc_event_handle_bytes:
            raise KernelError(f"event handle of {len(handle)} bytes, expected {self.ipc_event_handle_bytes}")
        out = ctypes.c_void_p()
        self._check(self.lib.kvd_event_open_ipc(handle, device, ctypes.byref(out)), "cudaIpcOpenEventHandle")
        return int(out.value)

    def event_destroy(self, event: int) -> None:
        self._check(self.lib.kvd_event_destroy(event), "cudaEventDestroy")

    def engine_signal(self, word_dev_ptr: int, value: int, stream: int, by_kernel: bool = False) -> None:
        """Engine side: enqueue on ``stream`` the GPU's write of ``value`` (uint64) into the fence
        word at ``word_dev_ptr`` (the device address of host memory mapped by
        `host_register_mapped`, 8-byte aligned), after the work enqueued there so far: the
        driver's ``cuStreamWriteValue64`` (memory barrier first) where it is available, else (or
        with ``by_kernel``) a one-thread kernel.

        Raises:
            KernelError: misaligned pointer, or the launch failed.
        """
        fn = self.lib.kvd_engine_signal_by_kernel if by_kernel else self.lib.kvd_engine_signal
        self._check(fn(word_dev_ptr, value, stream), "kvd_engine_signal")

    def host_register_mapped(self, ptr: int, size_bytes: int) -> int:
        """Page-lock ``[ptr, ptr + size_bytes)`` of host memory and map it for the GPU to write
        (cudaHostRegisterMapped); returns its device address. Undo with `host_unregister`."""
        out = ctypes.c_void_p()
        self._check(self.lib.kvd_host_register_mapped(ptr, size_bytes, ctypes.byref(out)), "cudaHostRegister(mapped)")
        return int(out.value)

    def lane_cancel(self, lane: int, lo: int, hi: int) -> int:
        """Fail the deferred `kvd_dma` requests of ``lane`` whose fence word lies in ``[lo, hi)``
        (their completion tokens come with bit 62 set: nothing copied); returns how many."""
        n = self.lib.kvd_lane_cancel(lane, lo, hi)
        if n < 0:
            raise KernelError("kvd_lane_cancel: invalid arguments")
        return n

    def error_text(self, rc: int) -> str:
        return {KVD_EINVAL: "invalid arguments", KVD_EALIGN: "misaligned",
                KVD_ECUDA: f"CUDA error: {self.lib.kvd_last_cuda_error().decode()}"}.get(rc, f"code {rc}")



def _cache_dir(arch: str) -> Path:
    return user_cache_dir() / "kernels" / f"{source_hash()}-sm{arch}"


def build_kernels(out_path: Path, arch: str) -> None:
    """Compile the kernels with nvcc into ``out_path`` for one SM arch (static cudart, C ABI).

    Raises:
        FileNotFoundError: no nvcc on PATH / in $CUDA_HOME.
        subprocess.CalledProcessError: compilation failed.
    """
    _build.build(out_path, [arch])


def _device_arch() -> str:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}{minor}"
    return "90"


def kernels_source() -> str:
    """Where `load_kernels` would take the library from, without loading or building it:
    ``"env"`` ($KVDEPOT_KERNELS_SO), ``"packaged"`` (built at install), ``"cache"`` (the per-user
    cache), ``"jit"`` (nvcc is here and may build it on first use), ``"torch"`` (none of those:
    the torch fallback). What ``kvdepot_build_info{kernels}`` reports."""
    if os.environ.get(ENV_SO):
        return "env"
    if PACKAGED_SO.exists():
        return "packaged"
    # any arch's build of this source in the cache (asking the GPU for its arch would start CUDA
    # in the caller; the daemon calls this at start-up, before any engine registered)
    if any(_cache_dir("*").parent.glob(f"{source_hash()}-sm*/libkvdepot_kernels.so")):
        return "cache"
    if os.environ.get(ENV_NO_JIT) != "1" and _build.find_nvcc() is not None:
        return "jit"
    return "torch"


_loaded: Kernels | None = None
_load_failed = False
_load_error: str | None = None  # why `load_kernels` returned None


def load_kernels() -> Kernels | None:
    """The kernel library (cached per process), or None if it cannot be found or built."""
    global _loaded, _load_failed, _load_error
    if _loaded is not None or _load_failed:
        return _loaded
    try:
        path = os.environ.get(ENV_SO)
        if not path and PACKAGED_SO.exists():
            try:
                _loaded = Kernels(str(PACKAGED_SO))
                return _loaded
            except (OSError, KernelError) as exc:  # e.g. an editable checkout whose source changed since
                log.info("not using the kernels built at install (%s)", exc)
        if not path:
            arch = _device_arch()
            d = _cache_dir(arch)
            so = d / "libkvdepot_kernels.so"
            if not so.exists():
                if os.environ.get(ENV_NO_JIT) == "1":
                    raise FileNotFoundError(f"{so} missing and {ENV_NO_JIT}=1")
                d.mkdir(parents=True, exist_ok=True)
                with open(d / "build.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    if not so.exists():  # another process may have built it meanwhile
                        log.info("building CUDA kernels for sm_%s into %s", arch, so)
                        build_kernels(so, arch)
            path = str(so)
        _loaded = Kernels(path)
    except Exception as exc:  # noqa: BLE001 - fall back to torch, loudly once
        _load_failed = True
        _load_error = str(exc)
        log.warning("CUDA kernels unavailable (%s); using the torch fallback (correct, slower)", exc)
    return _loaded


def load_error() -> str | None:
    """Why `load_kernels` found no library (e.g. a .so built from other source), or None."""
    return _load_error


def copy_blocks_torch(group: LayerGroup, layer_tensors: Sequence[torch.Tensor], block_ids: Sequence[int],
                      first_slot: int, num_slots: int, staging: torch.Tensor, object_bytes: int, chunk_size: int,
                      to_staging: bool) -> None:
    """Torch reference of `Kernels.copy_blocks` (also the fallback and the test oracle).

    Args:
        layer_tensors: per layer of the group, a uint8 tensor starting at the layer view's first
            byte and covering its extent (any device).
        block_ids: one id per slot from slot 0 (``num_chunks * blocks_per_chunk``).
        staging: uint8 tensor of whole objects, same device as the layers.
    """
    v = group.view
    bpc = chunk_size // v.block_size
    L, hk = group.num_layers, v.num_heads * v.num_kv
    for slot in range(first_slot, first_slot + num_slots):
        j, i = divmod(slot, bpc)
        b = block_ids[slot]
        if b < 0:  # left unwritten (a RETRIEVE's -1)
            continue
        for layer, t in enumerate(layer_tensors):
            eng = torch.as_strided(t, (v.block_size, v.num_heads, v.num_kv, v.row_bytes),
                                   (v.token_stride, v.head_stride, v.kv_stride, 1),
                                   t.storage_offset() + b * v.block_stride)
            base = j * object_bytes + group.object_offset
            obj = torch.as_strided(staging, (v.block_size, v.num_heads, v.num_kv, v.row_bytes),
                                   (L * hk * v.row_bytes, v.num_kv * v.row_bytes, v.row_bytes, 1),
                                   staging.storage_offset() + base + (i * v.block_size * L + layer) * hk * v.row_bytes)
            if to_staging:
                obj.copy_(eng)
            else:
                eng.copy_(obj)
